"""dspark::moe_experts and dspark::moe_experts_mxfp4 on a CUDA GPU: V4-Flash shapes in bf16 (the op
picks the GEMV decode schedule up to ``DECODE_MAX_PAIRS`` (token, slot) pairs, the grouped kernels
above; both forced on either side), CUDA-graph capture, AOTInductor with a dynamic token count.

bf16 tolerance: both the kernel and the bf16 reference are compared with the reference evaluated in
fp32 on the same bf16 inputs; the kernel's error may be at most twice the bf16 reference's plus
1e-3 of the output scale (the rounding points are the same, the GEMM summation order is not).
MXFP4: random packed bytes and E8M0 exponents 116..119 (|w| <= 6 * 2^-8); the fp32 reference
dequantises them exactly, so the same bound applies (also to the ``tl.dot_scaled`` variant, the op's default with bf16 x).
"""
from __future__ import annotations

import pytest
import torch

# One xdist worker for the module (under ``--dist loadgroup``): each worker that runs its tests builds
# the V4-Flash fixtures (17 GB of bf16 weights), and six of them outgrow an 80 GB H100 (session 32).
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("moe_flash_shapes"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import dspark_trt.plugins  # noqa: E402,F401
from dspark_trt.plugins.moe_experts import moe_experts_ref  # noqa: E402
from dspark_trt.plugins.moe_experts_mxfp4 import moe_experts_mxfp4_ref  # noqa: E402

DEV = "cuda"
D, H, E, K = 4096, 2048, 256, 6                 # deepseek-v4-flash-dspark: hidden, moe_intermediate, experts, top-k


@pytest.fixture(scope="module")
def flash_weights():
    g = torch.Generator(device=DEV).manual_seed(0)          # drawn in bf16: no 17 GB fp32 temporaries
    w13 = torch.randn(E, 2 * H, D, device=DEV, generator=g, dtype=torch.bfloat16).mul_(D ** -0.5)
    w2 = torch.randn(E, D, H, device=DEV, generator=g, dtype=torch.bfloat16).mul_(H ** -0.5)
    return w13, w2


@pytest.fixture(scope="module")
def flash_mxfp4():
    """(w13_packed, w13_scale, w2_packed, w2_scale) at V4-Flash shapes."""
    g = torch.Generator(device=DEV).manual_seed(2)
    byte = lambda *shape, lo=0, hi=256: torch.randint(lo, hi, shape, device=DEV, generator=g, dtype=torch.uint8)  # noqa: E731
    return (byte(E, 2 * H, D // 2), byte(E, 2 * H, D // 32, lo=116, hi=120),
            byte(E, D, H // 2), byte(E, D, H // 32, lo=116, hi=120))


def _routing(M, seed=1):
    """x [M, D] bf16, k distinct global expert ids per token (one slot -1), routing weights."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, D, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(M, E, device=DEV, generator=g).topk(K, -1).indices
    ids[0, -1] = -1                                                   # a skipped slot
    w = torch.rand(M, K, device=DEV, generator=g)
    return x, ids, w


def _ref(x, ids, w, w13, w2, first_expert, rows, ref=moe_experts_ref):
    """The reference a few tokens at a time (it gathers every slot's weights): ``w13`` / ``w2`` a
    tensor each, or (packed, scale) pairs for ``moe_experts_mxfp4_ref``."""
    weights = (*w13, *w2) if isinstance(w13, tuple) else (w13, w2)
    return torch.cat([ref(x[i:i + rows], ids[i:i + rows], w[i:i + rows], *weights, first_expert, 10.0)
                      for i in range(0, x.shape[0], rows)])


def _check_bf16(got, x, ids, w, w13, w2, first_expert, ref=moe_experts_ref):
    """The kernel's error against the fp32 reference <= 2x the bf16 reference's + 1e-3 of the scale."""
    ref16 = _ref(x, ids, w, w13, w2, first_expert, 4, ref).float()
    wide = (lambda t: t) if isinstance(w13, tuple) else (lambda t: t.float())
    ref32 = _ref(x.float(), ids, w, wide(w13), wide(w2), first_expert, 2, ref)
    scale = ref32.abs().max()
    err, err16 = (got.float() - ref32).abs().max(), (ref16 - ref32).abs().max()
    assert err <= 2 * err16 + 1e-3 * scale, (float(err), float(err16), float(scale))


@pytest.mark.parametrize("M, first_expert, E_local", [(1, 0, E), (5, 0, E), (37, 128, 128)])
def test_flash_shapes_bf16(flash_weights, M, first_expert, E_local):
    """E_local < E: the second expert-parallel rank's block (ids below it are skipped)."""
    w13, w2 = (t[E - E_local:] for t in flash_weights)
    x, ids, w = _routing(M)
    got = torch.ops.dspark.moe_experts(x, ids, w, w13, w2, first_expert, 10.0)
    _check_bf16(got, x, ids, w, w13, w2, first_expert)


@pytest.mark.parametrize("M, first_expert, E_local", [(1, 0, E), (16, 0, E), (37, 128, 128)])
def test_mxfp4_flash_shapes_bf16(flash_mxfp4, M, first_expert, E_local):
    w13p, w13s, w2p, w2s = (t[E - E_local:] for t in flash_mxfp4)
    x, ids, w = _routing(M)
    got = torch.ops.dspark.moe_experts_mxfp4(x, ids, w, w13p, w13s, w2p, w2s, first_expert, 10.0)
    _check_bf16(got, x, ids, w, (w13p, w13s), (w2p, w2s), first_expert, moe_experts_mxfp4_ref)


@pytest.mark.parametrize("M", [1, 16])
def test_mxfp4_dot_scaled_variant_flash_shapes(flash_mxfp4, M):
    """The ``tl.dot_scaled`` inner product (the op's default with bf16 x; DSPARK_MXFP4_DOT_SCALED=0
    turns it off), same bound."""
    from dspark_trt.plugins.kernels.moe import moe_experts_mxfp4_triton
    w13p, w13s, w2p, w2s = flash_mxfp4
    x, ids, w = _routing(M)
    got = moe_experts_mxfp4_triton(x, ids, w, w13p, w13s, w2p, w2s, 0, 10.0, dot_scaled=True, schedule="grouped")
    _check_bf16(got, x, ids, w, (w13p, w13s), (w2p, w2s), 0, moe_experts_mxfp4_ref)


@pytest.mark.parametrize("schedule", ["grouped", "decode"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_both_schedules_flash_shapes(flash_weights, flash_mxfp4, schedule, fmt):
    """Each schedule forced on both sides of ``DECODE_MAX_PAIRS`` (3 tokens: 18 pairs; 30: 180) and
    on the second expert-parallel rank's block; same bound."""
    from dspark_trt.plugins.kernels import moe as kmoe
    for M, first_expert in ((3, 0), (30, 128)):
        x, ids, w = _routing(M, seed=M)
        if fmt == "bf16":
            w13, w2 = (t[first_expert:] for t in flash_weights)
            got = kmoe.moe_experts_triton(x, ids, w, w13, w2, first_expert, 10.0, schedule=schedule)
            _check_bf16(got, x, ids, w, w13, w2, first_expert)
        else:
            w13p, w13s, w2p, w2s = (t[first_expert:] for t in flash_mxfp4)
            got = kmoe.moe_experts_mxfp4_triton(x, ids, w, w13p, w13s, w2p, w2s, first_expert, 10.0,
                                                schedule=schedule)
            _check_bf16(got, x, ids, w, (w13p, w13s), (w2p, w2s), first_expert, moe_experts_mxfp4_ref)


@pytest.mark.parametrize("decode", ["words", "bytes", "e4m3"])
def test_mxfp4_decode_schedule_exact_in_fp32(flash_mxfp4, decode):
    """fp32 x: the GEMV schedule's E2M1 decode (both routes keep the e = 0 codes as fp32
    subnormals, which a flush to zero would lose: 1 in 8 codes) equals the fp32 reference up to
    summation order, 1e-5 of the scale."""
    from dspark_trt.plugins.kernels.moe import moe_experts_mxfp4_triton
    w13p, w13s, w2p, w2s = flash_mxfp4
    x, ids, w = _routing(2, seed=3)
    got = moe_experts_mxfp4_triton(x.float(), ids, w, w13p, w13s, w2p, w2s, 0, 10.0, schedule="decode",
                                   decode=decode)
    ref = _ref(x.float(), ids, w, (w13p, w13s), (w2p, w2s), 0, 1, moe_experts_mxfp4_ref)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt, decode", [("mxfp4", "e4m3"), ("mxfp4", "words"), ("bf16", None)])
def test_decode_schedule_with_pdl_flash_shapes(flash_weights, flash_mxfp4, fmt, decode):
    """``pdl=True`` (the down and slot-sum kernels launched early, waiting on their inputs; the
    default on sm_90+, ``moe_decode.auto_pdl``): the same bits as ``pdl=False``, eager and on every
    replay of a CUDA graph; x of 1 and 16 tokens."""
    from dspark_trt.plugins.kernels import moe as kmoe
    for M in (1, 16):
        x, ids, w = _routing(M, seed=7)
        if fmt == "mxfp4":
            run = lambda pdl: kmoe.moe_experts_mxfp4_triton(x, ids, w, *flash_mxfp4, 0, 10.0,  # noqa: E731
                                                            schedule="decode", decode=decode, pdl=pdl)
        else:
            run = lambda pdl: kmoe.moe_experts_triton(x, ids, w, *flash_weights, 0, 10.0,  # noqa: E731
                                                      schedule="decode", pdl=pdl)
        want = run(False)
        assert torch.equal(run(True), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(True)
        for _ in range(3):
            captured.zero_()
            graph.replay()
            assert torch.equal(captured, want)


@pytest.mark.parametrize("M", [1, 16])
def test_mxfp4_decode_tiles_flash_shapes(flash_mxfp4, M):
    """Each MXFP4 decode tile (``moe_decode.decode_tile``: the default below ``DECODE_WIDE_PAIRS``
    pairs, ``DECODE_WIDE`` from there) at 1 and 16 tokens, either side of its own range; the
    reference's bound."""
    from dspark_trt.plugins.kernels import moe as kmoe
    from dspark_trt.plugins.kernels.moe_decode import DECODE_DEFAULTS, DECODE_WIDE
    x, ids, w = _routing(M, seed=11)
    for tile in (DECODE_DEFAULTS["mxfp4"], DECODE_WIDE, {**DECODE_DEFAULTS["mxfp4"], "k_stages": 3},
                 {**DECODE_WIDE, "k_stages": 3}):
        got = kmoe.moe_experts_mxfp4_triton(x, ids, w, *flash_mxfp4, 0, 10.0, schedule="decode", **tile)
        _check_bf16(got, x, ids, w, flash_mxfp4[:2], flash_mxfp4[2:], 0, moe_experts_mxfp4_ref)


@pytest.mark.parametrize("decode", ["words", "bytes", "e4m3"])
def test_gemv_decodes_every_code_exactly_on_gpu(decode):
    """Every E2M1 code at every word position, x from 2^-60 to 2^60, on the GPU's fp32 units
    (subnormal operands of the words route's multiplies kept): exact."""
    from tests.support.mxfp4_codes import every_code_case
    r = every_code_case("cuda", decode)
    assert r["exact"], r["runs"]


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_op_in_cuda_graph(flash_weights, flash_mxfp4, fmt):
    weights = flash_weights if fmt == "bf16" else flash_mxfp4
    op = torch.ops.dspark.moe_experts if fmt == "bf16" else torch.ops.dspark.moe_experts_mxfp4
    x, ids, w = _routing(5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(x, ids, w, *weights, 0, 10.0)                                  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, ids, w, *weights, 0, 10.0)
    x2, ids2, w2_ = _routing(5, seed=7)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
    graph.replay()
    assert torch.equal(out, op(x2, ids2, w2_, *weights, 0, 10.0))


@pytest.mark.parametrize("fmt", ["fp32", "mxfp4"])
def test_aoti_package_with_dynamic_tokens(tmp_path, fmt):
    """A stacked tiny-V4 MoE (fp32 activations; experts fp32 or MXFP4) exported with M dynamic, the
    op kept as a plugin node, compiled by AOTInductor: equals the eager module at M = 1, 7, 300
    (atol 1e-5)."""
    import dataclasses
    from torch.export import Dim
    from dspark_trt.checkpoints.quant import quant_mxfp4_u8
    from dspark_trt.config import get_preset
    from dspark_trt.models.mxfp4_linear import mxfp4_experts_
    from dspark_trt.models.v4_moe import MoE, stack_experts_
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(get_preset("deepseek-v4-tiny-dspark").target), False).to(DEV)
    if fmt == "mxfp4":
        mxfp4_experts_(moe, quant_mxfp4_u8)
    stack_experts_(moe)
    d = moe.gate.weight.shape[1]
    m = Dim("m", min=1, max=4096)
    x, tok = torch.randn(5, d, device=DEV), torch.randint(0, 512, (5,), device=DEV)
    op = "moe_experts_mxfp4" if fmt == "mxfp4" else "moe_experts.default"
    with torch.no_grad():
        ep = torch.export.export(moe, (x, tok), dynamic_shapes=({0: m}, {0: m}), strict=False)
        assert any(op in str(n.target) for n in ep.graph.nodes)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "moe.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        for M in (1, 7, 300):
            x, tok = torch.randn(M, d, device=DEV), torch.randint(0, 512, (M,), device=DEV)
            torch.testing.assert_close(runner(x, tok), moe(x, tok), rtol=0, atol=1e-5)
