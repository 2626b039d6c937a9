"""Stacked V4 experts through ``dspark::moe_experts`` compute what the per-expert modules do.

fp32 modules from the tiny V4 config (8 experts, top-2, hash and score routing). Tolerance 1e-5
absolute on outputs of size ~1: the op sums the k slot outputs in fp32, the per-expert code adds
them into the output one expert at a time (same values, other order). The grouping by expert
itself (the Triton kernels) is checked against the reference in test_plugins_triton_interpret.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark_trt.config import get_preset
from dspark_trt.models.v4_moe import MoE, stack_experts_
from dspark_trt.parallel.v4 import _shard_moe_
from dspark_trt.plugins.moe_experts import moe_experts_ref

ATOL = 1e-5


def _cfg(**kw):
    return dataclasses.replace(get_preset("deepseek-v4-tiny-dspark").target, **kw)


def _moe(hashed: bool, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_cfg(**kw), hashed)
    with torch.no_grad():
        moe.gate.weight.mul_(4)                          # sharper routing: varied expert choices
    return moe


def _inputs(M=37, d=64, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, d, generator=g), torch.randint(0, vocab, (M,), generator=g)


@pytest.mark.parametrize("hashed", [False, True])
def test_stacked_moe_equals_per_expert_moe(hashed):
    moe = _moe(hashed)
    x, tok = _inputs()
    with torch.no_grad():
        want = moe(x, tok)
        assert stack_experts_(moe) == 1 and stack_experts_(moe) == 0          # idempotent
        got = moe(x, tok)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    names = {k for k, _ in moe.named_parameters()}
    assert {"w13", "w2"} <= names and not any(k.startswith("experts.") for k in names)
    assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32)


def test_reference_skips_ids_outside_the_local_block():
    """Expert e's output alone: its slots counted, -1 and the other ranks' ids (below and above
    the block) skipped, a token whose k slots all name e counted k times."""
    moe = _moe(False, n_shared_experts=0)
    stack_experts_(moe)
    x, _ = _inputs(M=4)
    E = moe.w13.shape[0]
    ids = torch.tensor([[3, -1], [3, 3], [E + 3, 1], [-1, -1]])
    w = torch.tensor([[0.5, 9.0], [0.25, 0.75], [9.0, 9.0], [9.0, 9.0]])
    with torch.no_grad():
        got = moe_experts_ref(x, ids, w, moe.w13[3:4], moe.w2[3:4], 3, moe.limit)   # local block {3}
        one = moe_experts_ref(x, torch.tensor([[0]] * 4), torch.ones(4, 1), moe.w13[3:4], moe.w2[3:4], 0,
                              moe.limit)
    torch.testing.assert_close(got, one * torch.tensor([[0.5], [1.0], [0.0], [0.0]]), rtol=0, atol=ATOL)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_sharded_then_stacked_ranks_sum_to_the_full_moe(expert_parallel):
    """Expert parallel (first_expert offsets) and tensor parallel (intermediate dim split): the
    ranks' stacked outputs sum to the unsharded per-expert output."""
    x, tok = _inputs()
    with torch.no_grad():
        want = _moe(False)(x, tok)
        total = torch.zeros_like(want)
        for rank in range(2):
            part = _shard_moe_(_moe(False), rank, 2, expert_parallel).inner
            stack_experts_(part)
            assert part.first_expert == (4 * rank if expert_parallel else 0)
            assert part.w13.shape == ((4, 64, 64) if expert_parallel else (8, 32, 64))
            total += part(x, tok)
    torch.testing.assert_close(total, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_experts_sharded_then_stacked_sum_to_the_full_moe(expert_parallel):
    """Routed experts in MXFP4 (``Mxfp4Linear``, intermediate 64 so that a TP rank's 32 columns of
    w2 are one scale group): unstacked they run dequantise + matmul; stacked per rank they run
    ``dspark::moe_experts_mxfp4`` on the rank's packed slices, and the ranks sum to the whole."""
    from dspark_trt.checkpoints.quant import quant_mxfp4_u8
    from dspark_trt.models.mxfp4_linear import mxfp4_experts_

    def mx_moe():
        moe = _moe(False, moe_intermediate_size=64)
        assert mxfp4_experts_(moe, quant_mxfp4_u8) == 3 * 8
        return moe

    x, tok = _inputs()
    with torch.no_grad():
        want = mx_moe()(x, tok)
        total = torch.zeros_like(want)
        for rank in range(2):
            part = _shard_moe_(mx_moe(), rank, 2, expert_parallel).inner
            stack_experts_(part)
            assert part.w13 is None and part.w13_packed.shape == ((4, 128, 32) if expert_parallel else (8, 64, 32))
            assert part.w2_scale.shape == ((4, 64, 2) if expert_parallel else (8, 64, 1))
            total += part(x, tok)
    torch.testing.assert_close(total, want, rtol=0, atol=ATOL)
    assert not torch.allclose(want, _moe(False, moe_intermediate_size=64)(x, tok), atol=1e-3)   # really MXFP4


def test_bad_shapes_are_named():
    moe = _moe(False)
    stack_experts_(moe)
    x, _ = _inputs(M=3)
    ids, w = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"w2 .* is not \[E=8, d=64, h=32\]"):
        torch.ops.dspark.moe_experts(x, ids, w, moe.w13, moe.w2[:, :, :16], 0, 1.0)
    with pytest.raises(ValueError, match="routing_weights"):
        torch.ops.dspark.moe_experts(x, ids, w[:, :1], moe.w13, moe.w2, 0, 1.0)


def test_stacked_moe_exports_with_dynamic_tokens():
    """torch.export keeps one dspark::moe_experts node (M dynamic); the program reproduces eager at
    other token counts."""
    from torch.export import Dim
    moe = _moe(False)
    stack_experts_(moe)
    x, tok = _inputs(M=5)
    m = Dim("m", min=1, max=512)
    with torch.no_grad():
        ep = torch.export.export(moe, (x, tok), dynamic_shapes=({0: m}, {0: m}), strict=False)
        nodes = [n for n in ep.graph.nodes if n.op == "call_function" and "moe_experts" in str(n.target)]
        assert len(nodes) == 1
        for M in (1, 64):
            x2, tok2 = _inputs(M=M, seed=M)
            torch.testing.assert_close(ep.module()(x2, tok2), moe(x2, tok2), rtol=0, atol=0)
