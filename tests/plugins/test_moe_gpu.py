"""dspark::moe_experts on a CUDA GPU: V4-Flash shapes in bf16, CUDA-graph capture, AOTInductor with
a dynamic token count.

bf16 tolerance: both the kernel and the bf16 reference are compared with the reference evaluated in
fp32 on the same bf16 inputs; the kernel's error may be at most twice the bf16 reference's plus
1e-3 of the output scale (the rounding points are the same, the GEMM summation order is not).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import dspark_trt.plugins  # noqa: E402,F401
from dspark_trt.plugins.moe_experts import moe_experts_ref  # noqa: E402

DEV = "cuda"
D, H, E, K = 4096, 2048, 256, 6                 # deepseek-v4-flash-dspark: hidden, moe_intermediate, experts, top-k


@pytest.fixture(scope="module")
def flash_weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(E, 2 * H, D, device=DEV, generator=g) * D ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, H, device=DEV, generator=g) * H ** -0.5).to(torch.bfloat16)
    return w13, w2


def _routing(M, seed=1):
    """x [M, D] bf16, k distinct global expert ids per token (one slot -1), routing weights."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, D, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(M, E, device=DEV, generator=g).topk(K, -1).indices
    ids[0, -1] = -1                                                   # a skipped slot
    w = torch.rand(M, K, device=DEV, generator=g)
    return x, ids, w


def _ref(x, ids, w, w13, w2, first_expert, rows):
    """The reference a few tokens at a time (it gathers every slot's weights)."""
    return torch.cat([moe_experts_ref(x[i:i + rows], ids[i:i + rows], w[i:i + rows], w13, w2, first_expert, 10.0)
                      for i in range(0, x.shape[0], rows)])


@pytest.mark.parametrize("M, first_expert, E_local", [(1, 0, E), (5, 0, E), (37, 128, 128)])
def test_flash_shapes_bf16(flash_weights, M, first_expert, E_local):
    """E_local < E: the second expert-parallel rank's block (ids below it are skipped)."""
    w13, w2 = (t[E - E_local:] for t in flash_weights)
    x, ids, w = _routing(M)
    got = torch.ops.dspark.moe_experts(x, ids, w, w13, w2, first_expert, 10.0).float()
    ref16 = _ref(x, ids, w, w13, w2, first_expert, 4).float()
    ref32 = _ref(x.float(), ids, w, w13.float(), w2.float(), first_expert, 2)
    scale = ref32.abs().max()
    err, err16 = (got - ref32).abs().max(), (ref16 - ref32).abs().max()
    assert err <= 2 * err16 + 1e-3 * scale, (float(err), float(err16), float(scale))


def test_op_in_cuda_graph(flash_weights):
    w13, w2 = flash_weights
    x, ids, w = _routing(5)
    want = torch.ops.dspark.moe_experts(x, ids, w, w13, w2, 0, 10.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.dspark.moe_experts(x, ids, w, w13, w2, 0, 10.0)      # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dspark.moe_experts(x, ids, w, w13, w2, 0, 10.0)
    x2, ids2, w2_ = _routing(5, seed=7)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
    graph.replay()
    assert torch.equal(out, torch.ops.dspark.moe_experts(x2, ids2, w2_, w13, w2, 0, 10.0))
    x.copy_(_routing(5)[0])


def test_aoti_package_with_dynamic_tokens(tmp_path):
    """A stacked tiny-V4 MoE (fp32) exported with M dynamic, the op kept as a plugin node, compiled
    by AOTInductor: equals the eager module at M = 1, 7, 300 (atol 1e-5)."""
    import dataclasses
    from torch.export import Dim
    from dspark_trt.config import get_preset
    from dspark_trt.models.v4_moe import MoE, stack_experts_
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(get_preset("deepseek-v4-tiny-dspark").target), False).to(DEV)
    stack_experts_(moe)
    d = moe.w13.shape[2]
    m = Dim("m", min=1, max=4096)
    x, tok = torch.randn(5, d, device=DEV), torch.randint(0, 512, (5,), device=DEV)
    with torch.no_grad():
        ep = torch.export.export(moe, (x, tok), dynamic_shapes=({0: m}, {0: m}), strict=False)
        assert any("moe_experts" in str(n.target) for n in ep.graph.nodes)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "moe.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        for M in (1, 7, 300):
            x, tok = torch.randn(M, d, device=DEV), torch.randint(0, 512, (M,), device=DEV)
            torch.testing.assert_close(runner(x, tok), moe(x, tok), rtol=0, atol=1e-5)
