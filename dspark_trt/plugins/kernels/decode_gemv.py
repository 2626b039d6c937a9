"""Decode GEMV (one token, or a few: up to ``MAX_ROWS``) with the decoder layer's elementwise work
fused into its prologue, and optional programmatic dependent launch (issue #21; the kernels of
``runtime/token_step.py``, not yet an ``LLM`` path).

``y[N] = W[N, K] @ p(x)`` per token, bf16 in and out, fp32 accumulation, where the prologue
``p`` is one of
- ``"none"``: ``x``;
- ``"rmsnorm"``: Qwen3's ``RMSNorm(h)`` with ``h = x + residual`` (``residual`` optional; its bf16
  sum is written to ``residual_out`` by program 0): the same roundings as ``models.layers.RMSNorm``
  (fp32 ``h * rsqrt(mean(h^2) + eps) * g``, one rounding to bf16), the mean square taken in a
  first pass over ``h`` (K values, from L2 after the first program);
- ``"swiglu"``: ``silu(gate) * up`` of a fused gate/up output ``x = [gate | up]`` (2K values), each
  product rounded to bf16 as ``F.silu(gate) * up`` does.
So a layer's norms and SwiGLU cost no launch and no round trip: q/k/v and gate/up take the norm,
down takes SwiGLU (the layout of ``pdl_gemv_probe.py``'s ``layer_fused`` chains).

Why (``benchmarks/results/pdl-gemv-probe-NVIDIA-H200-e057240.json.gz``): a GEMV of a few us loses
its ramp and tail to the gap between kernels. With ``pdl=True`` (sm_90+) the kernel is launched
with programmatic stream serialisation, lets its successor launch at once
(``gdc_launch_dependents``) and loads its first ``PRE_K`` weight columns before it waits for its
predecessor (``gdc_wait``): weights never depend on the previous kernel. On the H200 a 36-layer
chain of Qwen3-8B GEMVs ran at 84.7 % of the HBM roofline with PDL, 80.9 % without, cuBLAS 75.3 %.

The program owns ``BLOCK_N`` weight rows and the whole K (no split-K: the measured winners had
none) and keeps a ``[BLOCK_N, BLOCK_K]`` fp32 partial, reduced once after the loop. K must be a
multiple of ``BLOCK_K`` (the wrapper picks one) and of ``PRE_K``. Two to ``MAX_ROWS`` tokens (a
verify block, a draft block, a small batch) run ``decode_rows.py``'s kernel: split-K, tensor-core
tiles and a deferred norm scale (within about a bf16 ulp of these roundings, not bit for bit).
One token runs it too where its tile says ``ROWS`` (a ``config``, or a sweep's winner at M = 1,
``decode_rows.tile_for``: the GPU's shipped table, else ``decode_rows.CONFIGS``; split K for the
narrow projections), with the same deferred scale; other one-token winners are this kernel's tile.

fp8 weights (``w`` float8_e4m3fn with ``w_scale``, the Qwen3-FP8 layout of ``plugins.fp8_linear``:
``W[n, k] = w[n, k] * w_scale[n // 128, k // 128]``): both kernels stream the fp8 bytes (half of
bf16's) and convert them in registers (exact in fp32 and bf16). BLOCK_N is cut to divide 128, so a
program's rows share one row of scale blocks and the scale depends on the column only: each K tile
multiplies its prologue values (fp32, after the mean square / sums of squares, which stay those of h)
by their columns' scales, ``sum_k w[n, k] * (s[k] * p(x)[k])``: BLOCK_K multiplies per token and tile,
none per weight. The tensor-core body rounds those products to bf16 for ``tl.dot`` (one rounding per
activation, as the bf16-dequantised reference rounds each weight); the CUDA-core bodies keep fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import decode_rows
from ..fp8_linear import FP8_BLOCK, FP8_DTYPE, scale_shape
from .common import col_scale, gdc_launch_dependents, gdc_wait, launcher, pdl_launch, residual_sum, round_bf16, \
    swiglu_bf16

PROLOGUES = {"none": 0, "rmsnorm": 1, "swiglu": 2}
NONE, RMSNORM, SWIGLU = (tl.constexpr(v) for v in PROLOGUES.values())

# Winners of ``benchmarks/pdl_gemv_probe.py`` on the H200 (e057240), (N, K) -> tile; others: DEFAULT.
CONFIGS = {
    (6144, 4096): dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3),      # Qwen3-8B q/k/v fused
    (4096, 4096): dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=3),      # o
    (24576, 4096): dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),    # gate/up fused
    (4096, 12288): dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=3),     # down
}
DEFAULT = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3)
MAX_ROWS = 16            # tokens per call (more: a GEMM, ``skinny_gemm`` / ``F.linear``)


@triton.jit
def _inputs(x, res, res_out, g, offs, K, rstd, pid, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
            STORE_RES: tl.constexpr):
    """The prologue's bf16 values at columns ``offs``, as fp32 (``rstd``: RMSNORM's scale)."""
    if PROLOGUE == SWIGLU:                               # x = [gate | up]
        return swiglu_bf16(x, K, offs)
    h = residual_sum(x, res, res_out, offs, K, pid, HAS_RES, STORE_RES)
    if PROLOGUE == RMSNORM:
        return round_bf16(h * rstd * tl.load(g + offs).to(tl.float32))
    return h


@triton.jit
def _first_tile(w, N, stride_wn, BLOCK_N: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr):
    """(pid, the program's rows offs_n and their clamped int64 rn, columns rp, its first weight
    tile [BLOCK_N, PRE_K]); with PDL the successor is let go first and the predecessor waited
    for after the load (weights never depend on it)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
    rp = tl.arange(0, PRE_K)
    w0 = tl.load(w + rn[:, None] * stride_wn + rp[None, :])
    if PDL:
        gdc_wait()
    return pid, offs_n, rn, rp, w0


@triton.jit
def decode_gemv_kernel(x, res, res_out, g, w, y, scale, N, K, stride_wn, stride_sn, eps, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PROLOGUE: tl.constexpr,
                       HAS_RES: tl.constexpr, STORE_FIRST: tl.constexpr, STORE_MAIN: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH: tl.constexpr, K_STAGES: tl.constexpr = 1,
                       SCALED: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N),). x [K] ([2K] for SWIGLU), res / res_out [K] (HAS_RES), g [K]
    (RMSNORM), w [N, K] (row stride ``stride_wn``), y [N]. SCALED: w in fp8 e4m3, ``scale`` its fp32
    [cdiv(N, 128), cdiv(K, 128)] block scales (row stride ``stride_sn``; BLOCK_N divides 128), taken
    into the prologue's values column by column (``col_scale``). STORE_FIRST / STORE_MAIN: program 0
    writes h to res_out in the mean-square pass / in the product's pass. PREFETCH: the loop's next
    weight tile is loaded before the current one is reduced (the same sums in the same order).
    K_STAGES > 1: the weight loop as ``tl.range(num_stages=K_STAGES)``, so Triton's pipeliner copies
    the next tiles into shared memory (``cp.async``) while one is reduced; a plain ``range`` (and the
    launch's ``num_stages``) never pipelines loads that feed no ``tl.dot``. On an H100 (session 54,
    ``decode-rows-stages-NVIDIA-H100-80GB-HBM3-c293f47.json.gz``) no Qwen3-8B shape's best one-token
    tile gained (q/k/v 19.8 us plain against 20.6-22.9 staged, gate/up 70.0 against 71.3-72.2, down 37.0
    against 37.1-42.1); only narrow-K tiles did (down 16 x 256: 48.3 -> 38.2). A sweep dimension
    (``decode_rows_sweep.py --stages``), not a default."""
    pid, offs_n, rn, rp, w0 = _first_tile(w, N, stride_wn, BLOCK_N, PRE_K, PDL)
    nb = pid * BLOCK_N // 128                            # the rows' block of scales (SCALED)
    rk = tl.arange(0, BLOCK_K)
    last = K - BLOCK_K                                   # prefetches past the end reload the last tile
    if PREFETCH:
        wt = tl.load(w + rn[:, None] * stride_wn + (tl.minimum(PRE_K, last) + rk)[None, :])
    rstd = 1.0
    if PROLOGUE == RMSNORM:                              # the mean square of h over all K
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            h = _inputs(x, res, res_out, g, k + rk, K, 1.0, pid, NONE, HAS_RES, STORE_FIRST)
            ss += h * h
        rstd = tl.rsqrt((tl.sum(ss, 0) / K + eps).to(tl.float32))    # eps may arrive as fp64 (AOTI)
    acc = tl.sum(w0.to(tl.float32) * (_inputs(x, res, res_out, g, rp, K, rstd, pid, PROLOGUE, HAS_RES, STORE_MAIN)
                                       * col_scale(scale, nb, stride_sn, rp, SCALED))[None, :], 1)
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(PRE_K, K, BLOCK_K, num_stages=K_STAGES):
        if PREFETCH:
            cur = wt
            wt = tl.load(w + rn[:, None] * stride_wn + (tl.minimum(k + BLOCK_K, last) + rk)[None, :])
        else:
            cur = tl.load(w + rn[:, None] * stride_wn + (k + rk)[None, :])
        part += cur.to(tl.float32) * (_inputs(x, res, res_out, g, k + rk, K, rstd, pid, PROLOGUE, HAS_RES, STORE_MAIN)
                                      * col_scale(scale, nb, stride_sn, k + rk, SCALED))[None, :]
    acc += tl.sum(part, 1)
    tl.store(y + offs_n, acc.to(y.dtype.element_ty), mask=offs_n < N)


def config_for(N: int, K: int) -> dict:
    """The measured tile of (N, K), else ``DEFAULT`` with BLOCK_K cut to a power of two dividing K."""
    cfg = dict(CONFIGS.get((N, K)) or DEFAULT)
    while K % cfg["BLOCK_K"] and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    return cfg


def decode_gemv(x: Tensor, w: Tensor, prologue: str = "none", residual: Tensor | None = None,
                norm_weight: Tensor | None = None, eps: float = 1e-6, out: Tensor | None = None,
                residual_out: Tensor | None = None, config: dict | None = None, pdl: bool = False,
                pre_k: int | None = None, w_scale: Tensor | None = None) -> Tensor:
    """``prologue(x) @ w[N, K]^T`` (module doc) for one token, x [K] -> ``out`` [N], or for M <=
    ``MAX_ROWS`` tokens, x [M, K] -> [M, N] (allocated if None). ``"swiglu"``: x [2K] / [M, 2K];
    ``residual`` / ``residual_out`` shaped like a K-wide x (``"rmsnorm"`` / ``"none"``: h = x +
    residual, written to ``residual_out`` if given); ``norm_weight`` [K] (``"rmsnorm"``).
    ``pdl``: launch with programmatic dependent launch (CUDA sm_90+). ``pre_k``: weight columns
    loaded before the wait (default BLOCK_K). ``w_scale``: with w in float8_e4m3fn (and only then),
    its fp32 block scales [cdiv(N, 128), cdiv(K, 128)] (``fp8_linear.scale_shape``): W[n, k] = w[n, k] *
    w_scale[n // 128, k // 128]."""
    if prologue not in PROLOGUES:
        raise ValueError(f"decode_gemv: prologue {prologue!r} is not one of {sorted(PROLOGUES)}")
    N, K = (int(d) for d in w.shape)
    fp8 = w.dtype == FP8_DTYPE
    bad = [n for n, t in (("x", x), ("w", w), ("residual", residual), ("norm_weight", norm_weight))
           if t is not None and t.dtype != torch.bfloat16 and not (n == "w" and fp8)]
    if bad:
        raise ValueError(f"decode_gemv: {', '.join(bad)} must be bfloat16 (its prologue rounds as bf16 modules do; "
                         f"w may be float8_e4m3fn with w_scale)")
    if fp8 != (w_scale is not None):
        raise ValueError("decode_gemv: a float8_e4m3fn w needs w_scale (its block scales)" if fp8 else
                         f"decode_gemv: w_scale is for a float8_e4m3fn w, not {w.dtype}")
    if fp8 and (w_scale.dtype != torch.float32 or tuple(w_scale.shape) != scale_shape(N, K)):
        raise ValueError(f"decode_gemv: w_scale is {w_scale.dtype} {list(w_scale.shape)}; fp8 w [N={N}, K={K}] wants "
                         f"float32 {list(scale_shape(N, K))} (one scale per {FP8_BLOCK} x {FP8_BLOCK} block)")
    want = 2 * K if prologue == "swiglu" else K
    M = 1 if x.dim() == 1 else int(x.shape[0])
    if x.dim() > 2 or x.shape[-1] != want or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"decode_gemv: x has shape {list(x.shape)}; w [N={N}, K={K}] with prologue "
                         f"{prologue!r} wants [{want}] or [M, {want}] with 1 <= M <= {MAX_ROWS}")
    if prologue == "rmsnorm" and (norm_weight is None or norm_weight.numel() != K):
        raise ValueError(f"decode_gemv: prologue 'rmsnorm' needs norm_weight of {K} values")
    if residual is not None and (prologue == "swiglu" or residual.numel() != M * K):
        raise ValueError(f"decode_gemv: residual must have {M} x {K} values and a 'none' / 'rmsnorm' prologue")
    if residual_out is not None and (residual is None or residual_out.numel() != M * K
                                     or residual_out.data_ptr() in (residual.data_ptr(), x.data_ptr())):
        raise ValueError(f"decode_gemv: residual_out needs a residual and {M} x {K} values of its own (other "
                         f"programs still read x and residual while program 0 writes it)")
    kw = pdl_launch(pdl, "decode_gemv", x)
    w, x = w.contiguous(), x.contiguous()
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    res = residual.contiguous() if residual is not None else x
    r_out = residual_out if residual_out is not None else y
    g = norm_weight if norm_weight is not None else x
    w_scale = w_scale.contiguous() if fp8 else None
    if M == 1 and not config:
        config = decode_rows.tile_for(1, N, K, x.device, fp8)   # a sweep's one-token winner, if any
    if M > 1 or (config and config.get("ROWS")):
        cfg = _fit_scales(dict(config) if config else decode_rows.choose_config(M, N, K, x.device, fp8), fp8)
        _check_tile(K, int(cfg["BLOCK_K"]), pre_k)
        rows = (lambda t: t.view(M, -1)) if M == 1 else (lambda t: t)        # one token as a row
        decode_rows.decode_rows(rows(x), w, rows(y), PROLOGUES[prologue], rows(res), rows(r_out), g, float(eps),
                                residual is not None, residual_out is not None, w_scale, cfg, pre_k, kw)
        return y
    cfg = _fit_scales(dict(config) if config else config_for(N, K), fp8)
    bk, bn = int(cfg["BLOCK_K"]), int(cfg["BLOCK_N"])
    pre = _check_tile(K, bk, pre_k)
    scale, stride_sn = (w_scale, w_scale.stride(0)) if fp8 else (w, 0)           # w: a pointer never read
    launcher(decode_gemv_kernel)[(triton.cdiv(N, bn),)](
        x, res, r_out, g, w, y, scale, N, K, K, stride_sn, float(eps), BLOCK_N=bn, BLOCK_K=bk, PRE_K=pre,
        PROLOGUE=PROLOGUES[prologue], HAS_RES=residual is not None,
        STORE_FIRST=residual_out is not None and prologue == "rmsnorm",
        STORE_MAIN=residual_out is not None and prologue == "none", PDL=pdl, PREFETCH=bool(cfg.get("PREFETCH")),
        K_STAGES=int(cfg.get("K_STAGES", 1)), SCALED=fp8, num_warps=int(cfg.get("num_warps", 4)),
        num_stages=int(cfg.get("num_stages", 3)), **kw)
    return y


def _fit_scales(cfg: dict, fp8: bool) -> dict:
    """cfg, for fp8 weights with BLOCK_N cut to 128 (a program's rows in one row of scale blocks; the
    tiles are powers of two); ValueError where BLOCK_N does not divide 128."""
    if fp8:
        cfg["BLOCK_N"] = min(int(cfg["BLOCK_N"]), FP8_BLOCK)
        if FP8_BLOCK % cfg["BLOCK_N"]:
            raise ValueError(f"decode_gemv: BLOCK_N={cfg['BLOCK_N']} must divide {FP8_BLOCK} for fp8 weights "
                             f"(a program's rows in one block of scales)")
    return cfg


def _check_tile(K: int, bk: int, pre_k: int | None) -> int:
    """pre_k (default BLOCK_K), checked: powers of two, K a multiple of both, pre_k of BLOCK_K."""
    pre = int(pre_k or bk)
    if K % bk or K % pre or pre > K or pre % bk or pre & (pre - 1) or bk & (bk - 1):
        raise ValueError(f"decode_gemv: K={K} must be a multiple of BLOCK_K={bk} and of pre_k={pre} (<= K, a "
                         f"multiple of BLOCK_K), both powers of two")
    return pre
