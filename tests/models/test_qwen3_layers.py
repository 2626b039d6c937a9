"""``run_layers`` (each layer's MLP output added in the next layer's input norm, what the compiled
path fuses) against the plain per-layer ``forward``: bit-for-bit the same residual stream, taps and
KV caches, in bf16 where a different add order would show."""
from __future__ import annotations

import torch

from dspark_trt.models import build_models
from dspark_trt.models.layers import rope_cos_sin
from dspark_trt.models.qwen3 import run_layers
from tests.support.models import tiny_pair


def test_run_layers_equals_layer_by_layer_forward():
    pair = tiny_pair(layers=3)
    target, _ = build_models(pair, torch.bfloat16, "cpu", seed=0)
    cfg = target.config
    torch.manual_seed(0)
    x0 = torch.randn(2, 5, cfg.hidden_size, dtype=torch.bfloat16)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
    table = torch.tensor([[0, 1], [2, -1]])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x0.dtype)
    caches = [target.make_cache(6, 4, torch.bfloat16, "cpu") for _ in range(2)]

    x, want_taps = x0, []
    for i, layer in enumerate(target.model.layers):
        x = layer(x, cos, sin, caches[0]["k"][i], caches[0]["v"][i], table, positions, positions)
        want_taps.append(x)
    got, taps = run_layers(target.model.layers, x0, cos, sin, caches[1], table, positions, positions, (0, 2))
    assert torch.equal(got, x)
    assert torch.equal(taps[0], want_taps[0]) and torch.equal(taps[1], want_taps[2])
    pad = caches[0]["k"][0].shape[0] - 1                   # inert rows may land on the pad page
    for name in ("k", "v"):
        assert all(torch.equal(a[:pad], b[:pad]) for a, b in zip(caches[0][name], caches[1][name]))
    assert any(c[:pad].abs().sum() > 0 for c in caches[1]["k"])            # the layers did write
