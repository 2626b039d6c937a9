"""dspark::fp8_linear (issue #23): fp8 e4m3 weights with 128x128 fp32 block scales.

On CPU: the kernel through the Triton interpreter (Triton 3.9's interpreter loads float8e4nv and
converts it exactly, checked here over all 256 codes but the two NaNs) in a subprocess, against the
exact product; the op's reference, the quantiser and the argument checks. On a GPU (``-m gpu``):
the kernel at Qwen3-8B projection shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_trt.plugins.fp8_linear import (FP8_DTYPE, dequantize_fp8, fp8_linear_ref, quantize_fp8,
                                           scale_shape)

from tests.support.interpreter import interpreter_results  # noqa: E402
from tests.support.cond_graphs import cond_leaf_args  # noqa: E402
from tests.support.fp8_gemm_cases import ACT_QUANT_CASES, CASES, MMA_CASES  # noqa: E402

# fp32 accumulation, one rounding to the output dtype: <= 0.5 ulp on a GPU; the interpreter
# truncates fp32 -> bf16 (< 1 ulp); plus fp32 sum-order noise.
ULP_TOL = 1.05
FP32_REL_TOL = 1e-6            # fp32 outputs: max |y - exact| / max |exact|


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton", reason="Triton is not installed")
    return interpreter_results("tests.support.fp8_gemm_cases")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_exact_product(results, case):
    """Within one rounding of the exact product; ``SCALE_W`` configs: of the exact product with the
    reference's weights (W8 * S rounded to x's dtype), which they compute."""
    name, M, N, K, dt = case[:5]
    r = results[name]
    scaled = "_w_rounded" if (case[5] or {}).get("SCALE_W") else ""
    assert r["shape"] == [M, N]
    if dt == "fp32":
        assert r["rel" + scaled] <= FP32_REL_TOL, r
    else:
        assert r["ulp" + scaled] <= ULP_TOL, r
    assert r["bitwise"], "two calls differ: the split-K reduction is not deterministic"


@pytest.mark.parametrize("case", MMA_CASES, ids=[c[0] for c in MMA_CASES])
def test_w8a8_mma_variant_matches_its_quantised_operands(results, case):
    """The opt-in W8A8 variant: within 1 ulp of the exact product of its fp8 activations and
    weights; the activation rounding itself moves the output by < 2^-4 of its largest entry here
    (e4m3 keeps 3 mantissa bits; an empirical bound on these inputs, not a guarantee)."""
    r = results[case[0]]
    assert r["shape"] == list(case[1:3]) and r["ulp"] <= ULP_TOL, r
    assert 0 < r["act_quant_rel"] < 2.0 ** -4, r


@pytest.mark.parametrize("case", ACT_QUANT_CASES, ids=[c[0] for c in ACT_QUANT_CASES])
def test_in_kernel_w8a8_matches_its_quantised_operands(results, case):
    """``act_quant``: the kernel quantises x per (token, 128-column group) itself, exactly as the
    torch reference does (same codes and scales), so its output is within one rounding (fp32: sum
    order) of the exact product of the reference's operands, for both bodies, every bucket, an
    all-zero group, split K and odd K; and deterministic."""
    r = results[case[0]]
    assert r["shape"] == list(case[1:3]), r
    if case[4] == "fp32":
        assert r["rel"] <= FP32_REL_TOL, r
    else:
        assert r["ulp"] <= ULP_TOL, r
    assert r["bitwise"], r


def test_act_quant_reference_quantises_per_token_group():
    """W8A8 reference: each (token, 128-group) scaled by its amax / 448 into e4m3; the op's value is
    the fp32 product of the two dequantised operands, and differs from the weight-only one."""
    from dspark_trt.plugins.fp8_linear import quantize_activation_groups, quantize_activations_fp8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 300, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[0, 0, :128] = 0
    q, sc = quantize_activation_groups(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and sc.shape == (2, 3, 3)
    assert (q[0, 0, :128].float() == 0).all() and sc[0, 0, 0] > 0               # an all-zero group
    assert q.float().abs().amax(-1).max() == 448.0
    xd = quantize_activations_fp8(x)
    assert ((xd - x).abs() <= x.abs() * 2 ** -4 + 1e-30).all()                  # e4m3: 3 mantissa bits
    w8, s = quantize_fp8(torch.randn(64, 300, generator=g))
    y = fp8_linear_ref(x, w8, s, act_quant=True)
    want = (xd.double() @ dequantize_fp8(w8, s, torch.float64).T).float()
    for b in range(2):                                    # fp32 sums: relative to each batch's largest output
        assert (y[b] - want[b]).abs().max() <= 1e-5 * want[b].abs().max()
        assert (fp8_linear_ref(x, w8, s)[b] - want[b]).abs().max() > 1e-4 * want[b].abs().max()


def test_act_quant_configs():
    """W8A8 launches: tl.dot tiles of one 128-column group without SCALE_W, CUDA-core tiles of whole
    groups; configs that cannot quantise in the kernel are refused by name."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import fp8_gemm as fg
    for bucket in fg.TOKEN_BUCKETS:
        for N, K in ((6144, 4096), (24576, 4096), (4096, 12288)):
            c = fg.w8a8_config(fg.bucket_config(bucket, N, K), bucket, N, K)
            assert not c.get("SCALE_W") and not c.get("BY_M")
            assert c["BLOCK_K"] == 128 if c.get("DOT") else c["BLOCK_K"] % 128 == 0, (bucket, c)
            if c.get("DOT"):                          # a measured tl.dot entry may bring its own token tile
                assert c["BLOCK_M"] >= 16, (bucket, c)
            else:
                assert c["BLOCK_M"] == fg.bucket_config(bucket, N, K)["BLOCK_M"], (bucket, c)
    x, (w8, s) = torch.randn(4, 256), quantize_fp8(torch.randn(64, 256))
    for cfg in (dict(BLOCK_N=64, BLOCK_K=256, DOT=True, SCALE_W=True), dict(BLOCK_N=16, BLOCK_K=64, DOT=False),
                fg.by_m_config(64, 256)):
        with pytest.raises(ValueError, match="act_quant"):
            fg.fp8_gemm(x, w8, s, cfg, act_quant=True)


def test_mma_variant_is_opt_in(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import fp8_gemm as fg
    monkeypatch.delenv(fg.MMA_ENV, raising=False)
    assert not fg.choose_config(4096, 4096, 4096).get("MMA")
    monkeypatch.setenv(fg.MMA_ENV, "256")
    assert fg.choose_config(4096, 4096, 4096)["MMA"] and not fg.choose_config(255, 4096, 4096).get("MMA")


def test_interpreter_converts_every_fp8_code(results):
    assert results["codes_exact"], "TRITON_INTERPRET's float8e4nv -> fp32 differs from torch"
    assert results["codes_exact_bits"], "the CUDA-core body's bit-pattern decode differs from torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [True, False])
def test_cuda_core_body_decodes_every_code_on_gpu(bits):
    """Every non-NaN e4m3 code, subnormals included (a flush to zero of the bit-pattern route's
    fp32 subnormals would lose 14 codes), exactly."""
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    from tests.support.fp8_gemm_cases import every_code_weights
    x, w8, s, want = every_code_weights("cuda")
    assert torch.equal(fp8_gemm(x, w8, s, dict(BLOCK_N=64, BLOCK_K=128, DOT=False, BITS=bits)), want)


def test_reference_is_dequantise_then_linear():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 200).bfloat16()
    w8, s = quantize_fp8(torch.randn(130, 200))
    y = torch.ops.dspark.fp8_linear(x, w8, s)             # CPU: the reference
    assert y.shape == (3, 5, 130) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, dequantize_fp8(w8, s, torch.bfloat16)))
    assert torch.equal(fp8_linear_ref(x, w8, s), y)


def test_quantize_round_trip_error_bound():
    """e4m3 keeps 3 mantissa bits: |deq - w| <= 2^-4 |w| (normal range) + 2^-10 scale (subnormals)."""
    torch.manual_seed(1)
    w = torch.randn(300, 260) * torch.logspace(-3, 2, 300)[:, None]
    w8, s = quantize_fp8(w)
    assert w8.dtype == FP8_DTYPE and s.dtype == torch.float32 and tuple(s.shape) == scale_shape(300, 260) == (3, 3)
    blk = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    err = (dequantize_fp8(w8, s, torch.float32) - w).abs()
    assert bool((err <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * blk).all())
    assert float(w8.float().abs().max()) <= 448.0
    assert torch.equal(quantize_fp8(torch.zeros(4, 4))[1], torch.ones(1, 1))   # zero block: scale 1


@pytest.mark.parametrize("bad, match", [
    (lambda w, s: (w.float(), s), "float8_e4m3fn"),
    (lambda w, s: (w, s[:, :1]), "weight_scale_inv"),
    (lambda w, s: (w, s.bfloat16()), "float32"),
])
def test_bad_arguments_are_named(bad, match):
    w8, s = quantize_fp8(torch.randn(130, 200))
    w, sc = bad(w8, s)
    with pytest.raises(ValueError, match=match):
        torch.ops.dspark.fp8_linear(torch.randn(2, 200), w, sc)
    with pytest.raises(ValueError, match="features"):
        torch.ops.dspark.fp8_linear(torch.randn(2, 199), w8, s)


QWEN3_8B_SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]   # q/o, k/v, gate/up, down (N, K)


def rounding_ulps(y, x, w8, s) -> float:
    """ulps of y from the nearer of the two exact products a config may compute: with the fp8
    weights times their scales (block-scaled tiles) or with the reference's weights, W8 * S rounded
    once to x's dtype (``SCALE_W`` tiles)."""
    from tests.support.fp8_gemm_cases import ulp_err
    xd = x.double().reshape(-1, x.shape[-1])
    y = y.reshape(xd.shape[0], -1)
    return min(ulp_err(y, xd @ dequantize_fp8(w8, s, torch.float64).T),
               ulp_err(y, xd @ dequantize_fp8(w8, s, x.dtype).double().T))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 3, 16, 64, 128])
def test_kernel_on_gpu_at_qwen3_8b_shapes(M):
    """The op on CUDA runs the kernel: within bf16 rounding of the exact product, bitwise
    run-to-run; within the bf16-dequantised reference's own error (its weights are rounded to bf16)."""
    from tests.support.fp8_gemm_cases import ulp_err
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in QWEN3_8B_SHAPES:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w8, s = quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * 0.02)
        exact = x.double() @ dequantize_fp8(w8, s, torch.float64).T
        y = torch.ops.dspark.fp8_linear(x, w8, s)
        assert rounding_ulps(y, x, w8, s) <= 0.55 + 1e-3 * K ** 0.5, (M, N, K)     # 0.5 ulp + fp32 order noise
        assert torch.equal(y, torch.ops.dspark.fp8_linear(x, w8, s))
        ref = fp8_linear_ref(x, w8, s)
        assert ulp_err(y, exact) <= max(ulp_err(ref, exact), 1.0) + 1e-3 * K ** 0.5, (M, N, K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_launch_for_any_m_on_gpu():
    """The engines' body (``by_m_config``: chosen by M inside the kernel) at Qwen3-8B shapes, on
    both sides of its switch and past one 64-token tile: within bf16 rounding of the exact product."""
    from dspark_trt.plugins.kernels.fp8_gemm import by_m_config, fp8_gemm
    from tests.support.fp8_gemm_cases import ulp_err
    g = torch.Generator(device="cuda").manual_seed(11)
    for N, K in QWEN3_8B_SHAPES:
        w8, s = quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * 0.02)
        for M in (1, 4, 5, 16, 130):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            exact = x.double() @ dequantize_fp8(w8, s, torch.float64).T
            assert ulp_err(fp8_gemm(x, w8, s, by_m_config(N, K)), exact) <= 0.55 + 1e-3 * K ** 0.5, (M, N, K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scale_w_tiles_on_gpu():
    """``SCALE_W`` tl.dot tiles (dequantised in registers, wide K tiles, 128-token tiles) at Qwen3-8B
    shapes: within bf16 rounding of the exact product with the reference's bf16 weights."""
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    from tests.support.fp8_gemm_cases import ulp_err
    g = torch.Generator(device="cuda").manual_seed(5)
    cfgs = ((8, dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_stages=3)),
            (130, dict(BLOCK_N=128, BLOCK_K=128, BLOCK_M=128, num_warps=8, num_stages=3)))
    for N, K in QWEN3_8B_SHAPES:
        w8, s = quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * 0.02)
        w_rounded = dequantize_fp8(w8, s, torch.bfloat16).double()
        for M, cfg in cfgs:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            y = fp8_gemm(x, w8, s, {**cfg, "DOT": True, "SCALE_W": True})
            assert ulp_err(y, x.double() @ w_rounded.T) <= 0.55 + 1e-3 * K ** 0.5, (M, N, K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w8a8_mma_variant_on_gpu():
    """The opt-in W8A8 variant at prefill-like M: within bf16 rounding (+ fp32 order noise) of the
    exact product of its quantised operands."""
    from dspark_trt.plugins.fp8_linear import quantize_activation_groups as quantize_activations
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm, mma_config
    from tests.support.fp8_gemm_cases import ulp_err
    g = torch.Generator(device="cuda").manual_seed(7)
    for M in (64, 300):
        for N, K in QWEN3_8B_SHAPES:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            w8, s = quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * 0.02)
            xq, xs = quantize_activations(x)
            xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]
            exact = xd @ dequantize_fp8(w8, s, torch.float64).T
            y = fp8_gemm(x, w8, s, mma_config(M, N, K))
            assert ulp_err(y, exact) <= 0.55 + 1e-3 * K ** 0.5, (M, N, K)


def test_kernel_configs_outside_the_scale_layout_are_named():
    """A tl.dot tile must lie inside one scale block (BLOCK_K <= 128); the CUDA-core body takes
    any power of two; an unknown split-K reduction is named."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    w8, s = quantize_fp8(torch.randn(64, 512))
    x = torch.randn(8, 512).bfloat16()
    with pytest.raises(ValueError, match="BLOCK_K=256"):
        fp8_gemm(x, w8, s, dict(BLOCK_N=32, BLOCK_K=256, DOT=True))
    with pytest.raises(ValueError, match="BLOCK_N=256"):
        fp8_gemm(x, w8, s, dict(BLOCK_N=256, BLOCK_K=128, DOT=False))
    with pytest.raises(ValueError, match="REDUCE"):
        fp8_gemm(x[:1], w8, s, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, DOT=False, REDUCE="atomic"))


def test_traced_calls_cache_no_fake_ticket_counters():
    """Under fake tensors (torch.compile / export trace the op's body) a split-K call reduces in
    two passes: the ticket counters are a cache shared by later real calls, and a fake tensor
    there would reach them (a CUDA device is only faked here)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from dspark_trt.plugins.kernels import common as kc, skinny_gemm as sg
    before = {d: list(b) for d, b in kc._COUNTERS.items()}
    with FakeTensorMode():
        x = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(512, 4096, dtype=FP8_DTYPE, device="cuda")
        y = torch.ops.dspark.fp8_linear(x, w, torch.empty(4, 32, device="cuda"))
        assert sg.SplitK.plan(1, 512, 4096, 1, 16, 512, 4, "ticket", x.device).reduce == sg.REDUCE_TWO_PASS
    assert tuple(y.shape) == (1, 512)
    assert {d: list(b) for d, b in kc._COUNTERS.items()} == before
    assert sg.SplitK.plan(1, 512, 4096, 1, 16, 512, 4, "ticket", torch.device("cpu")).reduce == sg.REDUCE_TICKET


def _trace_symbolic_tokens(monkeypatch, **kw):
    """``fp8_gemm`` on a [8, 4096] x [4096, 4096] case traced under fake tensors, x's tokens and
    features symbolic (torch.compile(dynamic=True) makes both): (launches as (grid, kwargs), y,
    x, the shape env's guards on the token count)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8, skinny_gemm as ksg
    launches = []

    class Recorder:              # kw["_args"]: the positional arguments, kw["_kernel"]: the kernel
        def __call__(self, kernel):
            self.kernel = kernel
            return self

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, {**kw, "_args": args, "_kernel": self.kernel}))

    monkeypatch.setattr(kfp8, "launcher", Recorder())
    monkeypatch.setattr(ksg, "launcher", Recorder())
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, static_shapes=False)

    def fake(t, name, dynamic):
        dims = [DimDynamic.DYNAMIC if dynamic else DimDynamic.STATIC] * t.dim()
        return mode.from_tensor(t, source=ConstantSource(name),
                                symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    w8, s = quantize_fp8(torch.randn(4096, 4096))
    x, w8, s = fake(torch.randn(8, 4096).bfloat16(), "x", True), fake(w8, "w", False), fake(s, "s", False)
    with mode:
        y = kfp8.fp8_gemm(x, w8, s, **kw)
    assert not isinstance(y.shape[0], int) and y.shape[1] == 4096
    guards = [g for g in env.guards if x.shape[0].node.expr.free_symbols & g.expr.free_symbols]
    return launches, y, x, guards


def test_symbolic_token_count_launches_one_kernel_for_every_m(monkeypatch):
    """A token count that is symbolic when the launch is built and no bucket given: one
    ``BODY_BY_M`` launch (+ the split-K reduction) whose grid is an expression of M, and no guard
    on M (export would otherwise specialise the engine to the traced size)."""
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8
    launches, y, x, guards = _trace_symbolic_tokens(monkeypatch)
    (grid, kw), *rest = launches
    assert kw["BODY"] == kfp8.BODY_BY_M and kw["BLOCK_M"] >= kfp8.BY_M_SMALL
    assert not isinstance(grid[2], int)                           # cdiv(M, BLOCK_M)
    cfg = kfp8.by_m_config(4096, 4096)
    assert len(rest) == (1 if max(cfg["SPLIT_K"], cfg["DOT_SPLIT_K"]) > 1 else 0)   # the two-pass reduction
    assert not guards, guards


@pytest.mark.parametrize("bucket", [1, 16, 32, 64, 128])
def test_host_bucket_launches_one_body(monkeypatch, bucket):
    """A bucket chosen on the host (``fp8_linear_bucketed``'s torch.cond): one launch of one body
    (CUDA-core for 1 token, tl.dot above) with the bucket's config (``bucket_config``), its grid an
    expression of M, no guard on M."""
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8
    launches, y, x, guards = _trace_symbolic_tokens(monkeypatch, bucket=bucket)
    (grid, kw), *rest = launches
    cfg = kfp8.bucket_config(bucket, 4096, 4096)
    assert kw["BODY"] == (kfp8.BODY_CUDA_CORE if bucket == 1 else kfp8.BODY_DOT)
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"], kw["SCALE_W"], grid[1]) == \
        (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"], bool(cfg.get("SCALE_W")), cfg["SPLIT_K"])
    assert not isinstance(grid[2], int)
    assert len(rest) == (1 if cfg["SPLIT_K"] > 1 else 0)
    assert not guards, guards


@pytest.mark.parametrize("bucket,act_quant", [(1, False), (16, False), (128, False), (1, True), (16, True),
                                               (128, True)])
def test_row_strides_reach_the_kernels_as_constants(monkeypatch, bucket, act_quant):
    """x's sizes and strides symbolic (a torch.cond branch under torch.compile(dynamic=True)): every
    row stride the kernels get is an int (the weight's K, N), so Triton compiles them with its
    divisible-by-16 hint; a symbolic stride took the compiled W8A8 verify to 2x the kernel time."""
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8
    launches, *_ = _trace_symbolic_tokens(monkeypatch, bucket=bucket, act_quant=act_quant)
    strides = {kfp8.fp8_gemm_kernel: (11, 12, 13, 14, 17), kfp8.act_quant_kernel: (5, 6, 7)}
    kernels = [kw["_kernel"] for _, kw in launches]
    assert kfp8.fp8_gemm_kernel in kernels and (kfp8.act_quant_kernel in kernels) == (act_quant and bucket > 1)
    for _, kw in launches:
        for i in strides.get(kw["_kernel"], ()):
            assert type(kw["_args"][i]) is int, (kw["_kernel"], i, kw["_args"][i])
    gemm = next(kw["_args"] for _, kw in launches if kw["_kernel"] is kfp8.fp8_gemm_kernel)
    assert gemm[11:15] == (4096, 4096, 32, 4096) and not isinstance(gemm[6], int)   # x, w, scale, y; M symbolic


def test_bucket_configs():
    """Token tiles per bucket: 1 token on the CUDA-core body; 16 / 32 on M = 16's tl.dot tiles; 64
    and 128 on their measured configs where the table has the shape (Qwen3-8B's fused gate/up: 128
    tokens per tile), else on 64-token tiles with at most 3 pipeline stages."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8
    assert not kfp8.bucket_config(1, 768, 2048)["DOT"] and kfp8.bucket_config(1, 768, 2048)["BLOCK_M"] == 1
    for bucket in (16, 32):
        assert kfp8.bucket_config(bucket, 768, 2048)["BLOCK_M"] == bucket
    for bucket in (64, 128):
        unmeasured = kfp8.bucket_config(bucket, 768, 2048)
        assert unmeasured["BLOCK_M"] == 64 and unmeasured["num_stages"] <= 3 and unmeasured["DOT"]
    assert kfp8.bucket_config(128, 24576, 4096) == kfp8.CONFIGS[(128, 24576, 4096)]
    assert kfp8.bucket_config(128, 24576, 4096)["BLOCK_M"] == 128
    with pytest.raises(ValueError, match="bucket=4"):
        kfp8.bucket_config(4, 4096, 4096)


def _cond_leaves(gm) -> list[int]:
    """The buckets of the dspark::fp8_linear calls under nested torch.cond, true branches first."""
    return cond_leaf_args(gm, (torch.ops.dspark.fp8_linear.default, torch.ops.dspark.fp8_linear), 3)


def test_symbolic_tokens_on_a_gpu_are_bucketed_on_the_host(monkeypatch):
    """An engine's export (dynamic batch and tokens) of an ``Fp8Linear`` on a GPU (the device check
    forced here; fake tensors only): nested torch.cond on the token count whose leaves call the op
    with buckets 1, 16, 32, 64 and 128; the builder's ReferenceOps sees the op (kept, or inlined on CPU).
    The program (run on CPU: the reference) equals the op on each side of every bucket bound."""
    import sys
    from torch.export import Dim
    from dspark_trt.builder.export import ReferenceOps
    from dspark_trt.models.fp8_linear import Fp8Linear
    torch.manual_seed(0)
    lin = Fp8Linear.from_linear(torch.nn.Linear(256, 384, bias=False))
    dims = ({0: Dim("batch", min=1, max=64), 1: Dim("tokens", min=1, max=64)},)
    plugin = sys.modules["dspark_trt.plugins.fp8_linear"]
    with monkeypatch.context() as m:
        m.setattr(plugin, "use_triton", lambda x: True)
        kept = ReferenceOps({"dspark::fp8_linear"})
        with torch.no_grad(), kept:
            ep = torch.export.export(lin, (torch.randn(2, 3, 256),), dynamic_shapes=dims, strict=False)
        inlined = ReferenceOps()
        with torch.no_grad(), inlined:
            torch.export.export(lin, (torch.randn(2, 3, 256),), dynamic_shapes=dims, strict=False)
    assert kept.kept == {"dspark::fp8_linear"} and inlined.inlined == {"dspark::fp8_linear"}
    assert _cond_leaves(ep.graph_module) == [1, 16, 32, 64, 128]
    assert len(ep.range_constraints) == 2                        # batch and tokens stayed dynamic
    for b, t in ((1, 1), (2, 1), (1, 4), (4, 4), (1, 17), (2, 16), (3, 11), (5, 13), (3, 43)):
        x = torch.randn(b, t, 256)
        assert torch.equal(ep.module()(x), fp8_linear_ref(x, lin.weight, lin.weight_scale_inv)), (b, t)


@pytest.mark.parametrize("act_quant", [False, True])
def test_torch_compile_buckets_the_tokens_on_the_host(monkeypatch, act_quant):
    """Under torch.compile (dynamo: a symbolic size looks like an int to isinstance) on a GPU (the
    device check forced, launches recorded, not run): a dynamic token count gets the nested
    torch.cond of the buckets, as in an engine's export; a count of 1 (specialised) its bucket
    alone. Before, dynamo's graph called the op without a bucket: one 64-token-tile launch for 8
    tokens, 2-2.7x the bucket's time in the compiled W8A8 step on the H200."""
    import sys
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.fp8_linear import fp8_linear_bucketed
    from dspark_trt.plugins.kernels import fp8_gemm as kfp8, skinny_gemm as ksg

    class NoLaunch:
        def __call__(self, kernel):
            return self

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    monkeypatch.setattr(sys.modules["dspark_trt.plugins.fp8_linear"], "use_triton", lambda x: True)
    monkeypatch.setattr(kfp8, "launcher", NoLaunch())
    monkeypatch.setattr(ksg, "launcher", NoLaunch())
    w8, s = quantize_fp8(torch.randn(256, 256))
    for tokens, buckets in ((8, [1, 16, 32, 64, 128]), (1, [1])):
        graphs = []

        def backend(gm, inputs):
            graphs.append(_cond_leaves(gm))
            return gm.forward
        torch._dynamo.reset()
        x = torch.randn(tokens, 256, dtype=torch.bfloat16)
        if tokens > 1:
            torch._dynamo.mark_dynamic(x, 0)
        torch.compile(lambda x, w, s: fp8_linear_bucketed(x, w, s, act_quant=act_quant), backend=backend,
                      dynamic=True, fullgraph=True)(x, w8, s)
        assert graphs == [buckets], (tokens, graphs)
    torch._dynamo.reset()


def test_concrete_tokens_call_the_op_directly():
    """Eager calls and CPU tensors: no torch.cond (the op picks its launch from the count)."""
    from dspark_trt.plugins.fp8_linear import fp8_linear_bucketed
    w8, s = quantize_fp8(torch.randn(130, 200))
    x = torch.randn(3, 200)
    assert torch.equal(fp8_linear_bucketed(x, w8, s), fp8_linear_ref(x, w8, s))
    assert torch.equal(fp8_linear_bucketed(x, w8, s, host_choice=True), fp8_linear_ref(x, w8, s))


def w8a8_ulps(y, x, w8, s) -> float:
    """ulps of y from the exact product of the W8A8 reference's operands (x's codes times their
    scales, the fp8 weights times theirs)."""
    from dspark_trt.plugins.fp8_linear import quantize_activations_fp8
    from tests.support.fp8_gemm_cases import ulp_err
    xd = quantize_activations_fp8(x.reshape(-1, x.shape[-1])).double()
    exact = xd @ dequantize_fp8(w8, s, torch.float64).T
    return ulp_err(y.reshape(exact.shape), exact)


# W8A8 on the GPU: the fp8 tensor-core dots add into fp32 every 32 columns, with fewer bits inside
# one dot; y is rounded to bf16 (0.5 ulp). Wrong codes or scales move outputs by several ulps.
W8A8_GPU_ULPS = 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 3, 16, 40, 64, 128, 300])
def test_in_kernel_w8a8_on_gpu_at_qwen3_8b_shapes(M):
    """``act_quant`` at Qwen3-8B shapes, with the launch the op picks for M and with every bucket
    that M fits (what engines run): near the exact product of the quantised operands."""
    from dspark_trt.plugins.kernels.fp8_gemm import TOKEN_BUCKETS, fp8_gemm
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in QWEN3_8B_SHAPES:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w8, s = quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * 0.02)
        for bucket in [0] + [b for b in TOKEN_BUCKETS if M <= b or b == TOKEN_BUCKETS[-1]]:
            y = fp8_gemm(x, w8, s, bucket=bucket, act_quant=True)
            assert w8a8_ulps(y, x, w8, s) <= W8A8_GPU_ULPS, (M, N, K, bucket, w8a8_ulps(y, x, w8, s))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act_quant", [False, True], ids=["weight_only", "w8a8"])
def test_bucketed_engine_network_on_gpu(tmp_path, act_quant):
    """AOTInductor package of fused fp8 q/k/v (Qwen3-8B shapes) with dynamic batch and tokens: the
    host-bucketed launches run, within bf16 rounding of the exact product (W8A8: of its quantised
    operands) at token counts on each side of every bucket bound, under CUDA-graph capture too."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export import Dim
    from dspark_trt.builder.backends.aoti import inductor_configs, select_compiler
    from dspark_trt.models.fp8_linear import Fp8Linear
    torch.manual_seed(3)
    lin = Fp8Linear.from_linear(torch.nn.Linear(4096, 6144, bias=False, device="cuda").to(torch.bfloat16))
    lin.act_quant = act_quant
    dims = ({0: Dim("batch", min=1, max=64), 1: Dim("tokens", min=1, max=64)},)
    with torch.no_grad():
        ep = torch.export.export(lin, (torch.randn(2, 3, 4096, device="cuda", dtype=torch.bfloat16),),
                                 dynamic_shapes=dims, strict=False)
    assert _cond_leaves(ep.graph_module) == [1, 16, 32, 64, 128]
    cfg = {k: v for k, v in inductor_configs(select_compiler()).items() if k != "aot_inductor.package_constants_in_so"}
    net = aoti_load_package(aoti_compile_and_package(ep, package_path=str(tmp_path / "qkv.pt2"), inductor_configs=cfg),
                            run_single_threaded=True)
    for b, t in ((1, 1), (1, 3), (2, 8), (1, 17), (4, 8), (5, 7), (16, 4), (16, 8), (20, 9)):
        x = torch.randn(b, t, 4096, device="cuda", dtype=torch.bfloat16)
        y = net(x)
        if act_quant:
            assert w8a8_ulps(y, x, lin.weight, lin.weight_scale_inv) <= W8A8_GPU_ULPS, (b, t)
        else:
            assert rounding_ulps(y, x, lin.weight, lin.weight_scale_inv) <= 0.55 + 1e-3 * 64, (b, t)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = net(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y), (b, t)
