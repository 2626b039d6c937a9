"""fp8 block-scaled GEMM kernel cases under ``TRITON_INTERPRET=1`` (run as a subprocess by
tests/plugins/test_fp8_linear.py): prints ``RESULT {json}`` with, per case, the error in units of
one ulp of the output dtype against the exact product ``x.float() @ (W8 * S).float().T`` and
whether two calls were bitwise equal."""
from __future__ import annotations

import json
import os

import torch

# (name, M, N, K, x dtype, config): N and K not multiples of 128 (partial scale blocks), several
# row / column scale blocks, K not a multiple of BLOCK_K, split-K, both bodies (CUDA-core M <= 4,
# tl.dot above), M tiling, fp32 activations, the default config.
CASES = [
    ("m1_split", 1, 200, 300, "bf16", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),
    ("m1_nosplit_even", 1, 256, 256, "bf16", dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)),
    ("m3_split3", 3, 130, 390, "bf16", dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3)),
    ("m8_dot", 8, 200, 300, "bf16", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),
    ("m8_cudacore", 8, 72, 160, "bf16", dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, DOT=False)),
    ("m16_default", 16, 136, 260, "bf16", None),
    ("m40_mtiles", 40, 150, 140, "bf16", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, BLOCK_M=16)),
    ("m5_fp32", 5, 129, 129, "fp32", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),
    ("m2_fp16", 2, 64, 200, "fp16", dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)),
    ("m3_bits", 3, 130, 390, "bf16", dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, BITS=True)),   # bit-pattern decode
    # CUDA-core tiles wider than a scale block (x scaled per column), ticket and two-pass split-K
    ("m1_wide_ticket", 1, 200, 700, "bf16", dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2)),
    ("m2_wide_nosplit", 2, 136, 600, "bf16", dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1)),
    ("m3_wide_two_pass", 3, 130, 900, "bf16", dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=3, REDUCE="two_pass")),
    ("m1_wide_bits", 1, 72, 520, "bf16", dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, BITS=True)),
    # one launch for any M (BODY_BY_M, what a symbolic token count gets): the CUDA-core side (M <= 4)
    # and the tl.dot side (wider DOT_BLOCK_N, several 64-token tiles), split-K both ways, odd K
    ("bym_m1", 1, 200, 700, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2)),
    ("bym_m3_two_pass", 3, 136, 600, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, REDUCE="two_pass")),
    ("bym_m5", 5, 200, 700, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2)),
    ("bym_m70_two_pass", 70, 150, 300, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2,
                                                   DOT_BLOCK_N=32, REDUCE="two_pass")),
    ("bym_m9_fp32", 9, 129, 260, "fp32", dict(BY_M=True, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1)),
    # the two bodies' own K slicings in one grid (trailing splits of the other body store zeros)
    ("bym_m1_dot_splits_more", 1, 200, 700, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2,
                                                         DOT_SPLIT_K=4)),
    ("bym_m20_dot_splits_more", 20, 200, 700, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1,
                                                           DOT_SPLIT_K=3, REDUCE="two_pass")),
    ("bym_m12_dot_splits_fewer", 12, 136, 900, "bf16", dict(BY_M=True, BLOCK_N=16, BLOCK_K=128, SPLIT_K=4,
                                                            DOT_SPLIT_K=1)),
    # the host-chosen launches of a symbolic M (``bucket_config``), also past their bucket's bound
    ("bucket1_m1", 1, 200, 700, "bf16", {"bucket": 1}),
    ("bucket1_m3", 3, 200, 700, "bf16", {"bucket": 1}),
    ("bucket1_m4_odd_k", 4, 136, 1100, "bf16", {"bucket": 1}),
    ("bucket32_m20", 20, 136, 1100, "bf16", {"bucket": 32}),
    ("bucket32_m70", 70, 136, 300, "bf16", {"bucket": 32}),
    ("bucket16_m5", 5, 200, 700, "bf16", {"bucket": 16}),
    ("bucket16_m40", 40, 200, 300, "bf16", {"bucket": 16}),
    ("bucket64_m17", 17, 150, 300, "bf16", {"bucket": 64}),
    ("bucket64_m130_fp32", 130, 129, 260, "fp32", {"bucket": 64}),
    # SCALE_W: tl.dot tiles dequantised in registers (W8 * S rounded once, as the reference), wide
    # tiles spanning several scale blocks, odd K, fp32 activations
    ("scalew_m8", 8, 200, 300, "bf16", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, DOT=True, SCALE_W=True)),
    ("scalew_m16_wide", 16, 136, 900, "bf16", dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, DOT=True, SCALE_W=True)),
    ("scalew_m40_fp32", 40, 129, 260, "fp32", dict(BLOCK_N=32, BLOCK_K=128, BLOCK_M=16, DOT=True, SCALE_W=True)),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| in ulps of y's dtype at |ref| (>= 1 ulp of 1.0 near zero)."""
    ulp = 2.0 ** (torch.floor(torch.log2(torch.clamp(ref.abs(), min=1.0))) - MANTISSA[y.dtype])
    return float(((y.float() - ref).abs() / ulp).max())


def case_inputs(i: int, M: int, N: int, K: int, dtype: torch.dtype):
    from dspark_trt.plugins.fp8_linear import quantize_fp8
    g = torch.Generator().manual_seed(i)
    x = torch.randn(M, K, generator=g).to(dtype)
    rows = torch.logspace(-2, 1, N)[:, None]                     # rows of different scales
    w8, s = quantize_fp8(torch.randn(N, K, generator=g) * rows)
    return x, w8, s


def codes_exact() -> bool:
    """Every float8e4nv code but the NaNs (0x7f, 0xff) converts to torch's fp32 value."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(src, dst, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + o).to(tl.float32))

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    got = torch.empty(256, dtype=torch.float32)
    src = torch.zeros(256, dtype=torch.float8_e4m3fn)
    src[:254] = codes
    convert[(1,)](src, got, BLOCK=256)
    return bool(torch.equal(got[:254], codes.float()))


def every_code_weights(device="cpu"):
    """(x [1, 128] fp32 = e_0, w8 [254, 128] with code n at row n, column 0, scale 1, want [1, 254]):
    ``x @ w8^T`` is each non-NaN e4m3 code's value, through whichever decode the kernel runs."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    w8 = torch.zeros(254, 128, dtype=torch.uint8)
    w8[:, 0] = codes
    w8 = w8.view(torch.float8_e4m3fn).to(device)
    x = torch.zeros(1, 128, device=device)
    x[0, 0] = 1.0
    return x, w8, torch.ones(2, 1, device=device), codes.view(torch.float8_e4m3fn).float().to(device)[None]


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1"            # set before triton is imported
    from dspark_trt.plugins.fp8_linear import dequantize_fp8, fp8_linear_ref
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    out = {}
    for i, (name, M, N, K, dt, cfg) in enumerate(CASES):
        x, w8, s = case_inputs(i, M, N, K, DTYPES[dt])
        exact = x.double() @ dequantize_fp8(w8, s, torch.float64).T
        kw = cfg if cfg and "bucket" in cfg else {"config": cfg}
        y1 = fp8_gemm(x, w8, s, **kw)
        y2 = fp8_gemm(x, w8, s, **kw)
        ref = fp8_linear_ref(x, w8, s)
        rel = float((y1.double() - exact).abs().max() / exact.abs().max())
        w_rounded = x.double() @ dequantize_fp8(w8, s, x.dtype).double().T      # the reference's weights, exactly
        out[name] = {"ulp": ulp_err(y1, exact), "rel": rel, "ulp_w_rounded": ulp_err(y1, w_rounded),
                     "rel_w_rounded": float((y1.double() - w_rounded).abs().max() / w_rounded.abs().max()), "ref_ulp": ulp_err(ref, exact), "bitwise": bool(torch.equal(y1, y2)),
                     "dtype": str(y1.dtype), "shape": list(y1.shape)}
    out["codes_exact"] = codes_exact()
    x, w8, s, want = every_code_weights()
    out["codes_exact_bits"] = bool(torch.equal(fp8_gemm(x, w8, s, dict(BLOCK_N=64, BLOCK_K=128, DOT=False)), want))
    out.update(mma_results())
    out.update(act_quant_results())
    print("RESULT " + json.dumps(out))



# W8A8 (MMA) variant: (name, M, N, K, config); compared with the exact product of the dequantised
# fp8 activations and weights (the activation quantisation is the variant's, done in torch).
MMA_CASES = [
    ("mma_m20_odd", 20, 200, 300, dict(MMA=True, BLOCK_M=16, BLOCK_N=64)),
    ("mma_m70_even", 70, 256, 256, dict(MMA=True, BLOCK_M=32, BLOCK_N=128)),
]


def mma_results() -> dict:
    from dspark_trt.plugins.fp8_linear import dequantize_fp8, quantize_activation_groups
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    out = {}
    for i, (name, M, N, K, cfg) in enumerate(MMA_CASES):
        x, w8, s = case_inputs(100 + i, M, N, K, torch.bfloat16)
        xq, xs = quantize_activation_groups(x)
        xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]
        exact = xd @ dequantize_fp8(w8, s, torch.float64).T
        full = x.double() @ dequantize_fp8(w8, s, torch.float64).T
        y = fp8_gemm(x, w8, s, cfg)
        out[name] = {"ulp": ulp_err(y, exact), "shape": list(y.shape),
                     "act_quant_rel": float((exact - full).abs().max() / full.abs().max())}
    return out


# In-kernel W8A8 (``act_quant``): (name, M, N, K, dtype, config or None, bucket); compared with the
# exact product of the W8A8 reference's operands (``quantize_activation_groups`` in torch).
ACT_QUANT_CASES = [
    ("actq_dot_odd_split", 20, 200, 300, "bf16", dict(BLOCK_N=64, BLOCK_K=128, DOT=True, SPLIT_K=2), 0),
    ("actq_core_groups", 2, 256, 640, "bf16", dict(BLOCK_N=16, BLOCK_K=256, DOT=False, SPLIT_K=2), 0),
    ("actq_core_fp32", 1, 128, 384, "fp32", None, 0),
    ("actq_dot_fp32", 9, 128, 256, "fp32", None, 0),
    ("actq_zero_group", 3, 128, 512, "bf16", None, 0),
] + [(f"actq_bucket{b}_m{M}", M, 192, 512, "bf16", None, b)
     for b, M in ((1, 1), (16, 5), (32, 17), (64, 40), (128, 70))]


def act_quant_results() -> dict:
    from dspark_trt.plugins.fp8_linear import dequantize_fp8, quantize_activations_fp8
    from dspark_trt.plugins.kernels.fp8_gemm import fp8_gemm
    out = {}
    for i, (name, M, N, K, dt, cfg, bucket) in enumerate(ACT_QUANT_CASES):
        x, w8, s = case_inputs(200 + i, M, N, K, DTYPES[dt])
        if name == "actq_zero_group":
            x[:, 128:256] = 0
        exact = quantize_activations_fp8(x).double() @ dequantize_fp8(w8, s, torch.float64).T
        y = fp8_gemm(x, w8, s, cfg, bucket=bucket, act_quant=True)
        rel = float((y.double() - exact).abs().max() / exact.abs().max())
        out[name] = {"ulp": ulp_err(y, exact), "rel": rel, "shape": list(y.shape),
                     "bitwise": bool(torch.equal(y, fp8_gemm(x, w8, s, cfg, bucket=bucket, act_quant=True)))}
    return out


if __name__ == "__main__":
    main()
