"""``decode_gemv`` cases under ``TRITON_INTERPRET=1`` (run as a subprocess by
tests/plugins/test_decode_gemv.py): prints ``RESULT {json}`` with, per case, the error in bf16
ulps against the torch reference of the same prologue (``models.layers.RMSNorm``, ``F.silu(gate) *
up``) times ``w`` in fp32, for RMSNorm also against the prologue in fp32 (this kernel's and the
modules' results), and whether the residual sum written equals torch's bf16 sum. ``FP8_CASES``: the
same with fp8 e4m3 weights and 128 x 128 block scales (``quantize_fp8`` of bf16 weights whose
magnitude varies by block), ``w`` being the dequantised weight in fp32 (``dequantize_fp8``)."""
from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn.functional as F

from tests.support.skinny_gemm_cases import ulp_err

# (name, prologue, N, K, residual, residual_out, config, pre_k, M): N not a multiple of BLOCK_N, PRE_K of
# one and two K tiles, every prologue with and without a residual; M None: one token x [K], else x [M, K]
# (M = 1 as a row, a power of two and not; the tensor-core body from M = 5 unless the config says; split K
# with the ticket reduction, both bodies, the default tile; one token on the rows kernel).
CASES = [
    ("none", "none", 37, 256, False, False, dict(BLOCK_N=8, BLOCK_K=64), None, None),
    ("none_pre2", "none", 40, 256, False, False, dict(BLOCK_N=8, BLOCK_K=64), 128, None),
    ("none_residual", "none", 24, 128, True, True, dict(BLOCK_N=16, BLOCK_K=32), None, None),
    ("rmsnorm", "rmsnorm", 33, 256, False, False, dict(BLOCK_N=8, BLOCK_K=64), None, None),
    ("rmsnorm_residual", "rmsnorm", 48, 192, True, True, dict(BLOCK_N=16, BLOCK_K=64), 64, None),
    ("rmsnorm_residual_no_out", "rmsnorm", 20, 128, True, False, dict(BLOCK_N=8, BLOCK_K=32), None, None),
    ("swiglu", "swiglu", 29, 256, False, False, dict(BLOCK_N=8, BLOCK_K=64), None, None),
    ("default_config", "none", 64, 1024, False, False, None, None, None),
    ("rows1_rmsnorm_residual", "rmsnorm", 24, 128, True, True, dict(BLOCK_N=8, BLOCK_K=32), None, 1),
    ("rows5_rmsnorm_residual", "rmsnorm", 37, 192, True, True, dict(BLOCK_N=8, BLOCK_K=64), 64, 5),
    ("rows8_none_residual", "none", 40, 128, True, True, dict(BLOCK_N=16, BLOCK_K=32), None, 8),
    ("rows3_swiglu", "swiglu", 29, 128, False, False, dict(BLOCK_N=8, BLOCK_K=64), None, 3),
    ("rows16_rmsnorm", "rmsnorm", 33, 128, False, False, dict(BLOCK_N=8, BLOCK_K=64), 128, 16),
    ("rows8_cuda_cores_rmsnorm_residual", "rmsnorm", 37, 128, True, True, dict(BLOCK_N=8, BLOCK_K=32, DOT=False),
     None, 8),
    ("rows2_dot_swiglu", "swiglu", 40, 128, False, False, dict(BLOCK_N=16, BLOCK_K=32, DOT=True), 64, 2),
    ("rows8_split4_rmsnorm_residual", "rmsnorm", 37, 256, True, True, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=4),
     None, 8),
    ("rows3_split2_cuda_cores_none_residual", "none", 24, 128, True, True,
     dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, DOT=False), 64, 3),
    ("rows7_split2_swiglu", "swiglu", 40, 256, False, False, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2), None, 7),
    ("rows7_default_config_rmsnorm", "rmsnorm", 64, 1024, False, False, None, None, 7),
    # one token on the rows kernel (a tile with ROWS): x [K] and x [1, K], both bodies, split K
    ("one_token_rows_split2_rmsnorm_residual", "rmsnorm", 37, 256, True, True,
     dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, DOT=False, ROWS=True), None, None),
    ("one_token_rows_dot_none_residual", "none", 40, 128, True, True,
     dict(BLOCK_N=16, BLOCK_K=32, DOT=True, ROWS=True), 64, None),
    ("one_row_rows_split2_swiglu", "swiglu", 29, 256, False, False,
     dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=2, ROWS=True), None, 1),
    # PREFETCH (the next weight tile loaded before the current one is reduced): both kernels' CUDA-core
    # bodies, a first tile of two K tiles, a K of one tile (nothing to prefetch), split K
    ("prefetch_rmsnorm_residual", "rmsnorm", 48, 192, True, True, dict(BLOCK_N=16, BLOCK_K=64, PREFETCH=True),
     None, None),
    ("prefetch_pre2_swiglu", "swiglu", 29, 256, False, False, dict(BLOCK_N=8, BLOCK_K=64, PREFETCH=True), 128, None),
    ("prefetch_one_tile_none", "none", 37, 64, False, False, dict(BLOCK_N=8, BLOCK_K=64, PREFETCH=True), None, None),
    ("one_token_rows_prefetch_split2_rmsnorm_residual", "rmsnorm", 37, 256, True, True,
     dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, DOT=False, ROWS=True, PREFETCH=True), None, None),
    ("rows3_prefetch_cuda_cores_swiglu", "swiglu", 29, 128, False, False,
     dict(BLOCK_N=8, BLOCK_K=32, DOT=False, PREFETCH=True), None, 3),
    # K_STAGES (the weight loop pipelined through shared memory): both kernels' CUDA-core bodies, split K
    ("stages3_rmsnorm_residual", "rmsnorm", 48, 256, True, True, dict(BLOCK_N=16, BLOCK_K=32, K_STAGES=3), None, None),
    ("one_token_rows_stages2_split2_rmsnorm_residual", "rmsnorm", 37, 256, True, True,
     dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, DOT=False, ROWS=True, K_STAGES=2), None, None),
    ("rows3_stages3_cuda_cores_swiglu", "swiglu", 29, 128, False, False,
     dict(BLOCK_N=8, BLOCK_K=32, DOT=False, K_STAGES=3), None, 3),
]
# fp8 weights (w_scale), the same fields: every prologue for one token on both kernels (PREFETCH, K_STAGES,
# BLOCK_N cut from 256 to 128) and for 2 and 5 tokens on the tensor-core body and 8 on the CUDA cores; split K;
# BLOCK_K below, at and above the 128-column scale blocks; an N ending inside a block of scale rows (328) and a
# K inside a block of scale columns (192); the tile options F16 and X8.
FP8_CASES = [
    ("fp8_none_residual", "none", 256, 512, True, True, dict(BLOCK_N=16, BLOCK_K=128), None, None),
    ("fp8_rmsnorm_residual_bn256_pre2", "rmsnorm", 384, 512, True, True, dict(BLOCK_N=256, BLOCK_K=64), 128, None),
    ("fp8_prefetch_swiglu", "swiglu", 328, 512, False, False, dict(BLOCK_N=16, BLOCK_K=256, PREFETCH=True), None,
     None),
    ("fp8_stages2_rmsnorm", "rmsnorm", 256, 192, False, False, dict(BLOCK_N=8, BLOCK_K=64, K_STAGES=2), None, None),
    ("fp8_default_config_none", "none", 256, 512, False, False, None, None, None),
    ("fp8_one_token_rows_split2_rmsnorm_residual", "rmsnorm", 256, 512, True, True,
     dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2, DOT=False, ROWS=True), None, None),
    ("fp8_one_token_rows_dot_none_residual", "none", 384, 512, True, True,
     dict(BLOCK_N=32, BLOCK_K=128, DOT=True, ROWS=True), None, None),
    ("fp8_one_row_rows_prefetch_swiglu", "swiglu", 256, 512, False, False,
     dict(BLOCK_N=8, BLOCK_K=256, DOT=False, ROWS=True, PREFETCH=True), None, 1),
    ("fp8_rows2_dot_none_residual", "none", 256, 512, True, True, dict(BLOCK_N=16, BLOCK_K=128, DOT=True), None, 2),
    ("fp8_rows2_dot_split2_rmsnorm_residual", "rmsnorm", 256, 512, True, True,
     dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, DOT=True), None, 2),
    ("fp8_rows2_dot_swiglu", "swiglu", 384, 512, False, False, dict(BLOCK_N=64, BLOCK_K=128, DOT=True), 256, 2),
    ("fp8_rows5_dot_split2_bn256_none_residual", "none", 384, 512, True, True,
     dict(BLOCK_N=256, BLOCK_K=64, SPLIT_K=2, DOT=True), None, 5),
    ("fp8_rows5_dot_rmsnorm_residual", "rmsnorm", 328, 512, True, False, dict(BLOCK_N=16, BLOCK_K=128, DOT=True),
     None, 5),
    ("fp8_rows5_dot_swiglu", "swiglu", 256, 192, False, False, dict(BLOCK_N=32, BLOCK_K=64, DOT=True), None, 5),
    ("fp8_rows8_cuda_cores_split2_none_residual", "none", 256, 512, True, True,
     dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, DOT=False), None, 8),
    ("fp8_rows8_cuda_cores_stages2_rmsnorm_residual", "rmsnorm", 384, 512, True, True,
     dict(BLOCK_N=32, BLOCK_K=256, DOT=False, K_STAGES=2), None, 8),
    ("fp8_rows8_cuda_cores_swiglu", "swiglu", 256, 512, False, False, dict(BLOCK_N=32, BLOCK_K=128, DOT=False), 256,
     8),
    ("fp8_rows7_default_config_rmsnorm", "rmsnorm", 256, 512, False, False, None, None, 7),
] + [
    # the tile options on the tensor-core body, one token, 2, 5 and 8: F16 (fp16 operands, each tile's block scale
    # on its product) and X8 (the fp8 tensor cores, the activations split into two e4m3 terms)
    (name.format(op.lower()), prologue, N, K, has_res, store_res, dict(tile, DOT=True, **{op: True}), pre, rows)
    for op in ("F16", "X8")
    for name, prologue, N, K, has_res, store_res, tile, pre, rows in (
        ("fp8_one_token_rows_dot_{}_rmsnorm", "rmsnorm", 256, 512, False, False,
         dict(BLOCK_N=32, BLOCK_K=128, ROWS=True), None, None),
        ("fp8_rows2_dot_{}_none_residual", "none", 256, 512, True, True, dict(BLOCK_N=16, BLOCK_K=128), None, 2),
        ("fp8_rows5_dot_{}_swiglu", "swiglu", 256, 192, False, False, dict(BLOCK_N=32, BLOCK_K=64), None, 5),
        ("fp8_rows8_dot_{}_split2_rmsnorm_residual", "rmsnorm", 328, 512, True, True,
         dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=2), 128, 8))
]
EPS = 1e-6


def reference(prologue: str, x, r, g):
    """The bf16 input the GEMV multiplies (x [K] or [M, K]), as the model's modules compute it,
    and h (x + r)."""
    from dspark_trt.models.layers import RMSNorm
    h = x if r is None else x + r
    if prologue == "swiglu":
        K = x.shape[-1] // 2
        return F.silu(x[..., :K]) * x[..., K:], h
    if prologue == "rmsnorm":
        norm = RMSNorm(h.shape[-1], EPS)
        norm.weight.data = g
        return norm(h), h
    return h, h


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1"          # set before triton is imported
    from dspark_trt.plugins.fp8_linear import FP8_BLOCK, dequantize_fp8, quantize_fp8, scale_shape
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    out = {}
    for i, (name, prologue, N, K, has_res, has_out, cfg, pre, M) in enumerate(CASES + FP8_CASES):
        gen = torch.Generator().manual_seed(i)
        rows = () if M is None else (M,)
        x = torch.randn(*rows, 2 * K if prologue == "swiglu" else K, generator=gen).bfloat16()
        w = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
        r = torch.randn(*rows, K, generator=gen).bfloat16() if has_res else None
        g = (1 + 0.1 * torch.randn(K, generator=gen)).bfloat16() if prologue == "rmsnorm" else None
        r_out = torch.full((*rows, K), float("nan")).bfloat16() if has_out else None
        fp8 = name.startswith("fp8_")
        if fp8:                             # blocks scaled by 0.25x .. 4x: a wrong block's scale shows
            mag = 2.0 ** torch.randint(-2, 3, scale_shape(N, K), generator=gen).float()
            w = (w.float() * mag.repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]).bfloat16()
            wq, w_scale = quantize_fp8(w)
            w = dequantize_fp8(wq, w_scale, torch.float32)
        gemv = functools.partial(decode_gemv, w=wq, w_scale=w_scale) if fp8 else functools.partial(decode_gemv, w=w)
        y = gemv(x, prologue=prologue, residual=r, norm_weight=g, eps=EPS, residual_out=r_out, config=cfg, pre_k=pre)
        xin, h = reference(prologue, x, r, g)
        rec = {"ulp": ulp_err(y, xin.float() @ w.float().T), "shape": list(y.shape), "dtype": str(y.dtype)}
        if prologue == "rmsnorm":           # against the prologue in fp32: this kernel and the modules
            exact = reference(prologue, h.float(), None, g.float())[0] @ w.float().T
            rec["ulp_exact"] = ulp_err(y, exact)
            rec["module_ulp_exact"] = ulp_err(F.linear(xin.float(), w.float()).bfloat16() if fp8 else F.linear(xin, w),
                                              exact)
        if has_out:
            rec["residual_equal"] = bool(torch.equal(r_out, h))
        if (cfg or {}).get("PREFETCH") or (cfg or {}).get("K_STAGES"):   # the same sums in the same order
            plain = {k: v for k, v in cfg.items() if k not in ("PREFETCH", "K_STAGES")}
            rec["prefetch_equal"] = bool(torch.equal(y, gemv(x, prologue=prologue, residual=r, norm_weight=g, eps=EPS,
                                                             config=plain, pre_k=pre)))
        if fp8 and not ({"F16", "X8"} & set(cfg or {})):   # unit scales: the bf16 path's bits for w's e4m3 in bf16
            fit = dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], FP8_BLOCK)) if cfg else None    # the same tile
            unit = functools.partial(decode_gemv, x, prologue=prologue, residual=r, norm_weight=g, eps=EPS, config=fit,
                                     pre_k=pre)
            rec["unit_scale_equal"] = bool(torch.equal(unit(wq, w_scale=torch.ones_like(w_scale)),
                                                       unit(wq.bfloat16())))
        out[name] = rec
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
