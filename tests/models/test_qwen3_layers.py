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


def test_rope_cos_sin_keeps_its_frequencies_and_not_while_tracing(monkeypatch):
    """``rope_cos_sin`` bit-equal to its formula (float64 angles, the half repeated, negative
    positions as 0) at two head dims and thetas, with its frequencies kept after the first eager
    call and not kept while torch.export traces it (an engine computes them in its graph)."""
    from dspark_trt.models import layers

    def formula(pos, D, theta, dtype):
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = pos.clamp(min=0).to(torch.float64)[..., None] * inv
        ang = torch.cat([ang, ang], -1)[:, :, None, :]
        return ang.cos().to(dtype), ang.sin().to(dtype)

    class Rope(torch.nn.Module):
        def forward(self, pos):
            return rope_cos_sin(pos, 64, 5000.0, torch.bfloat16)

    monkeypatch.setattr(layers, "_ROPE_FREQS", {})          # (live graphs of other tests read theirs)
    pos = torch.randint(-1, 40000, (3, 11))
    ep = torch.export.export(Rope(), (pos,), strict=False)
    assert not layers._ROPE_FREQS
    assert not any(s.kind.name == "CONSTANT_TENSOR" for s in ep.graph_signature.input_specs)
    assert all(torch.equal(a, b) for a, b in zip(ep.module()(pos), formula(pos, 64, 5000.0, torch.bfloat16)))
    for D, theta in ((64, 10000.0), (128, 1e6)):
        for dtype in (torch.bfloat16, torch.float32):
            want = formula(pos, D, theta, dtype)
            for _ in range(2):                                   # computed, then kept
                got = rope_cos_sin(pos, D, theta, dtype)
                assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].shape == (3, 11, 1, D)
    assert set(layers._ROPE_FREQS) == {(64, 10000.0, torch.device("cpu")), (128, 1e6, torch.device("cpu"))}
