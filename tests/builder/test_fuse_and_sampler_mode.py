"""Fused q/k/v and gate/up projections compute what the separate ones do; the draft's block
sampler can be switched to the lossless top-k proposal."""
from __future__ import annotations

import random

import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.models.dspark_qwen3 import markov_sampler_op, topk_chunk
from dspark_trt.models.fuse import fuse_projections_
from dspark_trt.runtime import LLM, SamplingParams

from tests.support.models import tiny_pair


def _round(target, draft, B=2, T=6, seed=0):
    """Prefill, draft context and one draft block with fresh caches: (logits, taps, drafts, z)."""
    g = torch.Generator().manual_seed(seed)
    tcache = target.make_cache(8, 8, torch.float64, "cpu")
    dcache = draft.make_cache(8, 8, torch.float64, "cpu")
    table = torch.arange(B * 4).view(B, 4)
    tokens = torch.randint(0, 60, (B, T), generator=g)
    pos = torch.arange(T).repeat(B, 1)
    logits, taps = target(tokens, pos, table, tcache)
    draft.context(taps, pos, table, dcache)
    anchor, start = logits[:, -1].argmax(-1), torch.full((B,), T)
    drafts, z = draft(anchor, start, table, torch.tensor([0.0, 0.8]), torch.tensor([1, 2]), dcache)
    return logits, taps, drafts, z


def test_fused_projections_equal_separate_ones():
    pair = tiny_pair()
    ref = _round(*build_models(pair, torch.float64, "cpu", seed=3))
    target, draft = build_models(pair, torch.float64, "cpu", seed=3)
    n = fuse_projections_(target) + fuse_projections_(draft)
    assert n == 2 * pair.target.num_hidden_layers + 2 * pair.draft.num_hidden_layers
    assert fuse_projections_(target) == 0                                # idempotent
    names = {k for k, _ in target.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in names)
    got = _round(target, draft)
    for a, b in zip(ref[:2] + ref[3:], got[:2] + got[3:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)         # float64: same math
    assert torch.equal(ref[2], got[2])


def test_fp8_projections_fuse_where_their_scale_blocks_stack():
    """fp8 q/k/v and gate/up with row counts on the 128 grid fuse into ``FusedFp8Linear`` (weights
    and block scales stacked): the same round as the separate ``Fp8Linear``s, and the checkpoint
    tensors split back into the published names unchanged. Off the grid, or mixed, they stay apart."""
    from dspark_trt.checkpoints.qwen3 import qwen3_target_tensors
    from dspark_trt.models.fp8_linear import Fp8Linear, fp8_linears_
    from dspark_trt.models.fuse import FusedFp8Linear
    pair = tiny_pair(hidden=256, heads=4, kv_heads=2, layers=3, draft_layers=1)   # q 256, k / v 128, gate / up 512
    target, draft = build_models(pair, torch.float64, "cpu", seed=5)
    assert fp8_linears_(target) == 7 * pair.target.num_hidden_layers
    ref, ref_tensors = _round(target, draft), qwen3_target_tensors(target)
    assert fuse_projections_(target) == 2 * pair.target.num_hidden_layers
    attn = target.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedFp8Linear) and attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert tuple(attn.qkv_proj.weight_scale_inv.shape) == (4, 2)
    target.to(torch.float32).to(torch.float64)                   # dtype casts leave fp8 codes and scales alone
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and attn.qkv_proj.weight_scale_inv.dtype == torch.float32
    got = _round(target, draft)
    for a, b in zip(ref[:2] + ref[3:], got[:2] + got[3:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(ref[2], got[2])
    tensors = qwen3_target_tensors(target)
    assert tensors.keys() == ref_tensors.keys()
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t   # noqa: E731
    assert all(torch.equal(bits(tensors[k]), bits(ref_tensors[k])) for k in tensors)
    odd = tiny_pair(hidden=192, heads=4, kv_heads=2, layers=3, draft_layers=1)      # k / v: 96 rows
    t2, _ = build_models(odd, torch.float64, "cpu", seed=5)
    fp8_linears_(t2)
    assert fuse_projections_(t2) == odd.target.num_hidden_layers                   # gate / up (384) only
    mixed, _ = build_models(pair, torch.float64, "cpu", seed=5)
    mixed.model.layers[0].mlp.gate_proj = Fp8Linear.from_linear(mixed.model.layers[0].mlp.gate_proj)
    assert fuse_projections_(mixed) == 2 * pair.target.num_hidden_layers - 1


def test_topk_chunk_gives_enough_candidates():
    for V in (64, 4096, 129280, 151936):
        c = topk_chunk(V)
        assert c & (c - 1) == 0 and c <= 4096
        assert -(-V // c) >= 4                       # several chunks -> several candidates each
    assert topk_chunk(151936) == 4096


def test_unknown_sampler_is_rejected_with_its_name():
    with pytest.raises(ValueError, match="'fastest'"):
        markov_sampler_op("fastest")


def test_topk_sampler_keeps_greedy_speculative_lossless():
    """With the top-k proposal the drafts differ, but the output is still the target's greedy."""
    pair = tiny_pair(block=5)
    target, draft = build_models(pair, torch.float64, "cpu", seed=7)
    llm = LLM(pair, target, draft, max_batch_size=3, max_seq_len=96, markov_sampler="topk")
    assert llm.networks.markov_sampler == "topk" and not hasattr(draft, "markov_sampler")  # an argument
    rng = random.Random(0)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    sp = SamplingParams(max_new_tokens=24)
    spec = llm.generate(prompts, sp, speculative=True)
    ar = llm.generate(prompts, sp, speculative=False)
    assert [s.output_ids for s in spec] == [a.output_ids for a in ar]
    U = torch.randn(2, 5, 64, dtype=torch.float64)
    w1, w2 = draft.markov_weights()
    _, z = markov_sampler_op("topk")(U, torch.tensor([1, 2]), w1, w2, torch.zeros(2),
                                     torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    finite = torch.isfinite(z).sum(-1)
    assert bool((finite < 64).all()) and bool((finite >= 4).all())   # a restricted proposal
