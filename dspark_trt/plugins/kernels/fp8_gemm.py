"""fp8 block-scaled weight-streaming GEMM: ``y[M, N] = x[M, K] @ (W8 * S)^T`` (issue #23).

``W8 [N, K] float8_e4m3fn`` row-major, ``S [ceil(N/128), ceil(K/128)] fp32`` (one scale per 128x128
block), x in bf16 / fp16 / fp32, y in x.dtype. Decode shapes are bound by the weight read, and fp8
halves it against bf16; the kernel streams W once (per M tile) in the layout of
``skinny_gemm.py``:

* Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``; a program owns BLOCK_N weight rows and
  one K slice. BLOCK_N is a power of two <= 128, so a tile's rows lie in one row of scale blocks.
* Per tile: the fp8 bytes are converted to x's dtype in registers (e4m3 -> bf16 / fp16 / fp32 is
  exact) and multiplied against x with fp32 accumulation.
  - ``tl.dot`` with W as the left operand for M > 2 ("swap AB"): BLOCK_K <= 128, one scale per
    tile, multiplied into the tile's partial sum; or (``SCALE_W``) the tile dequantised in
    registers, any BLOCK_K (``_dot_tiles``).
  - CUDA-core multiply-reduce per token for M <= 2 (M <= 4 in the by-M launch): BLOCK_K any power
    of two (a tile may span several scale blocks, so wide tiles stream 8-16 KB per load round); x is multiplied by its
    columns' block scales in fp32 (``x[k] * S[n // 128, k // 128]``, one gather per tile) before
    the products. ``BITS`` (opt-in) decodes e4m3 without a conversion instruction: the byte ``s
    eeee mmm`` as the fp32 bit pattern ``s 0000 eeee mmm 0...`` is its value times 2^-120 (e4m3
    subnormals land on fp32 subnormals, which Triton's fp32 multiplies keep), times 2^120 exact;
    the e4m3fn NaN codes 0x7F / 0xFF read as +-480 there (checkpoints hold none: quantisation
    clamps to 448). On the H200 it was slower than the ``.to(float32)`` route at every M = 1 shape
    (fp8-gemm-NVIDIA-H200-8fa3a00.json.gz: e.g. gate/up 36 vs 50 % of HBM, down 39 vs 52 %), so it
    stays off by default.
* Rows past N are clamped to N - 1 (dropped at the store); K is masked when ``K % BLOCK_K != 0``.
* SPLIT_K > 1: fp32 partials ``[SPLIT_K, M, N]`` summed in split order, deterministic, by the
  tile's last program (``REDUCE`` "ticket", the default: one launch) or a second kernel
  ("two_pass"), as in ``skinny_gemm.py`` (``SplitK``, ``store_split_k``).

``choose_config`` takes the measured winner of ``benchmarks/fp8_gemm_bench.py`` keyed by (M bucket,
N, K) from ``CONFIGS``, else ``default_config(M, N, K)``.

``MMA`` configs (``{"MMA": True, BLOCK_M, BLOCK_N, num_warps, num_stages}``) run the W8A8 variant
for larger M (prefill): x is quantised per (token, 128-wide K group) to fp8 e4m3 with an fp32 scale
(``quantize_activations_triton``), then ``fp8_mma_kernel`` takes fp8 x fp8 ``tl.dot``s (fp8
tensor cores on the H200) per 128-wide K block, scaled by ``x_scale[m, kb] * w_scale[nb, kb]``,
accumulated in fp32. It changes the numerics (activations rounded to 3 mantissa bits), so it is
opt-in: used only where ``DSPARK_FP8_MMA_MIN_M`` (read at call time) is set and M >= it, or when a
config asks for it; not yet measured.

``act_quant=True`` (W8A8 in both bodies, ``--quantization fp8-w8a8``): the same quantisation of x
(``plugins.fp8_linear.quantize_activation_groups``: per token and 128 columns, code = x * (448 /
amax) rounded to nearest even, scale = amax / 448). The ``tl.dot`` body reads the codes and
scales of one ``act_quant_kernel`` launch and runs fp8 x fp8 dots (fp8 tensor cores, nothing to
convert per weight); the CUDA-core body (M <= 2) quantises its x tiles itself. Configs from
``CONFIGS_W8A8``, else the weight-only config made to fit (``w8a8_config``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, launcher, pow2, round_bf16
from .skinny_gemm import H200_SMS, SplitK, m_bucket, store_split_k

SCALE_BLOCK = 128


@triton.jit
def _round_e4m3(v):
    """fp32 -> the nearest e4m3 value (ties to even), kept in fp32, for |v| <= 448: the interpreter's
    fp32 -> fp8 conversion truncates, the GPU's rounds to nearest even."""
    a = tl.abs(v)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)   # 3 mantissa bits
    sub = (a + 16384.0) - 16384.0                          # multiples of 2^-9 (the fp32 ulp at 2^14)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_groups(xf, INTERPRET_DOT: tl.constexpr):
    """fp32 ``[R, 128]`` (R groups of 128 columns) -> (fp8 e4m3 codes ``[R, 128]``, fp32 scales
    ``[R]``) as ``plugins.fp8_linear.quantize_activation_groups`` computes them: a = max(amax,
    1e-10), code = x * (448 / a) rounded to nearest even, scale = a / 448 (IEEE divisions, one
    per group)."""
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-10)      # plugins.fp8_linear.ACT_AMAX_MIN
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    q = tl.clamp(xf * inv[:, None], -448.0, 448.0)
    if INTERPRET_DOT:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def act_quant_kernel(x, xq, xs, K, G, stride_xm, stride_qm, stride_sm, GROUPS: tl.constexpr,
                     INTERPRET_DOT: tl.constexpr):
    """Grid (M, cdiv(G, GROUPS)): row m's 128-column groups g0 .. g0 + GROUPS - 1 of x [M, K] ->
    fp8 codes xq [M, K] and fp32 scales xs [M, G] (``_quantize_groups``)."""
    m = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    offs = g0 * 128 + tl.arange(0, GROUPS * 128)
    v = tl.load(x + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
    q, sc = _quantize_groups(tl.reshape(v, [GROUPS, 128]), INTERPRET_DOT)
    tl.store(xq + m * stride_qm + offs, tl.reshape(q, [GROUPS * 128]), mask=offs < K)
    gi = g0 + tl.arange(0, GROUPS)
    tl.store(xs + m * stride_sm + gi, sc, mask=gi < G)


@triton.jit
def _dot_tiles(x, w, s_row, k0, k_end, rn, rm, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET_DOT: tl.constexpr,
               SCALE_W: tl.constexpr, ACT_Q: tl.constexpr, xs, stride_xsm):
    """Swap-AB ``tl.dot`` over the K slice [k0, k_end): fp32 ``[BLOCK_N, BLOCK_M]``. Default
    (BLOCK_K <= 128): one scale per tile, multiplied into the tile's exact partial sum. ``SCALE_W``:
    the tile is dequantised in registers, ``W8 * S`` rounded once to x's dtype (the reference's
    weights: the same value up to summation order), and accumulated by the dot itself (no
    per-tile multiply of its result); any power-of-two BLOCK_K (one scale per column). ``ACT_Q``
    (W8A8, BLOCK_K = 128): x holds fp8 codes and xs their per (token, 128-column group) scales
    (``act_quant_kernel``); each fp8 x fp8 dot (fp8 tensor cores, added into fp32 registers every
    ACT_Q columns: 32 or 128) is scaled by ``xs[m, group] * S``."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr = w + rn[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptr = x + rm[:, None] * stride_xm + (k0 + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptr)
            xt = tl.load(x_ptr)
        else:
            kmask = (kk + offs_k) < k_end
            wt = tl.load(w_ptr, mask=kmask[None, :], other=0.0)
            xt = tl.load(x_ptr, mask=kmask[None, :], other=0.0)
        if ACT_Q:
            xsc = tl.load(xs + rm * stride_xsm + kk // 128)                      # [BM] fp32
            if INTERPRET_DOT:
                part = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(wt, tl.trans(xt), max_num_imprecise_acc=ACT_Q)  # fp8 x fp8, fp32 out
            acc += part * (xsc * tl.load(s_row + kk // 128))[None, :]
        elif SCALE_W:
            if EVEN_K:
                sv = tl.load(s_row + (kk + offs_k) // 128)                         # [BK] fp32
            else:
                sv = tl.load(s_row + (kk + offs_k) // 128, mask=kmask, other=0.0)
            wf = wt.to(tl.float32) * sv[None, :]
            if INTERPRET_DOT and x.dtype.element_ty == tl.bfloat16:     # the interpreter truncates to bf16
                wq = round_bf16(wf)
            else:
                wq = wf.to(x.dtype.element_ty)                            # W8 * S, one rounding
            if INTERPRET_DOT or x.dtype.element_ty == tl.float32:
                acc = tl.dot(wq.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(wq, tl.trans(xt), acc)
        else:
            sc = tl.load(s_row + kk // 128)                       # fp32 block scale of the tile
            if INTERPRET_DOT:                                     # the interpreter's bf16 tl.dot is wrong
                part = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), input_precision="ieee")
            elif x.dtype.element_ty == tl.float32:
                part = tl.dot(wt.to(tl.float32), tl.trans(xt), input_precision="ieee")
            else:
                part = tl.dot(wt.to(x.dtype.element_ty), tl.trans(xt))   # [BN, BK] @ [BK, BM], fp32 acc
            acc += part * sc
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    return acc


@triton.jit
def _cuda_core_tiles(x, w, s_row, k0, k_end, rn, row0, M, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, BITS: tl.constexpr,
                     ACT_Q: tl.constexpr = False, INTERPRET_DOT: tl.constexpr = False):
    """CUDA-core multiply-reduce of tokens row0 .. row0 + BLOCK_M - 1 (those < M) over [k0, k_end):
    fp32 ``[BLOCK_N, BLOCK_M]``. A tile may span several scale blocks, so x is scaled per column
    (fp32), not the sum. ``ACT_Q`` (BLOCK_K a multiple of 128): x is first quantised per
    128-column group as the W8A8 dot body does, and its dequantised value (code * scale) taken."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr = w + rn[:, None] * stride_wn + (k0 + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptr)
            sv = tl.load(s_row + (kk + offs_k) // 128)                             # [BK] fp32
        else:
            kmask = (kk + offs_k) < k_end
            wt = tl.load(w_ptr, mask=kmask[None, :], other=0.0)
            sv = tl.load(s_row + (kk + offs_k) // 128, mask=kmask, other=0.0)
        if BITS:                           # e4m3 bits as fp32 bits (value * 2^-120; e = 0: subnormal)
            b = wt.to(tl.uint8, bitcast=True).to(tl.int32)
            wf = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36
        else:
            wf = wt.to(tl.float32)
        for m in tl.static_range(BLOCK_M):                        # few tokens: one reduction each
            if row0 + m < M:
                xrow = x + (row0 + m) * stride_xm + kk + offs_k
                if EVEN_K:
                    xm = tl.load(xrow)
                else:
                    xm = tl.load(xrow, mask=kmask, other=0.0)
                xv = xm.to(tl.float32)
                if ACT_Q:
                    xq, xsc = _quantize_groups(tl.reshape(xv, [BLOCK_K // 128, 128]), INTERPRET_DOT)
                    xv = tl.reshape(xq.to(tl.float32) * xsc[:, None], [BLOCK_K])
                p = tl.sum(wf * (xv * sv)[None, :], axis=1)
                acc += tl.where(tl.arange(0, BLOCK_M)[None, :] == m, p[:, None], 0.0)
        w_ptr += BLOCK_K
    return acc


BODY_CUDA_CORE, BODY_DOT, BODY_BY_M = 0, 1, 2
BY_M_SMALL = 4                    # BODY_BY_M: the most tokens the CUDA-core body takes
BY_M_DOT_SMALL = 16               # ... and the most the narrow (16-token) tl.dot tiles take


@triton.jit
def _program(x, w, s, y, ws, counter, n0, m0, M, N, k0, k_end, stride_xm, stride_wn, stride_sn, stride_ym,
             pid_n, pid_k, pid_m, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT: tl.constexpr, REDUCE: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET_DOT: tl.constexpr,
             BITS: tl.constexpr, SCALE_W: tl.constexpr, ACT_Q: tl.constexpr = False, xs=None, stride_xsm=0):
    """Weight rows n0 .. n0 + BLOCK_N - 1 (within one row of scale blocks) x tokens m0 .. m0 +
    BLOCK_M - 1 over the K slice [k0, k_end), stored (or its split's partial) by ``store_split_k``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    s_row = s + (n0 // 128) * stride_sn                               # the tile's row of scale blocks
    if DOT:
        acc = _dot_tiles(x, w, s_row, k0, k_end, rn, tl.minimum(offs_m, M - 1), stride_xm, stride_wn, BLOCK_M,
                         BLOCK_N, BLOCK_K, EVEN_K, INTERPRET_DOT, SCALE_W, ACT_Q, xs, stride_xsm)
    else:
        acc = _cuda_core_tiles(x, w, s_row, k0, k_end, rn, m0, M, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_K, BITS, ACT_Q, INTERPRET_DOT)
    store_split_k(acc, y, ws, counter, offs_m, offs_n, M, N, stride_ym, pid_n, pid_k, pid_m, SPLIT_K, REDUCE)


@triton.jit
def fp8_gemm_kernel(x, w, s, y, ws, counter, M, N, K, K_SPLIT, SPLIT_K, stride_xm, stride_wn, stride_sn,
                    stride_ym, DOT_K_SPLIT, xs, stride_xsm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BODY: tl.constexpr, REDUCE: tl.constexpr, EVEN_K: tl.constexpr,
                    INTERPRET_DOT: tl.constexpr, BITS: tl.constexpr, SMALL_M: tl.constexpr = 4,
                    DOT_SMALL_M: tl.constexpr = 16, DOT_BLOCK_N: tl.constexpr = 64,
                    DOT_BLOCK_K: tl.constexpr = 128, DOT_EVEN_K: tl.constexpr = True, SCALE_W: tl.constexpr = False,
                    ACT_Q: tl.constexpr = False):
    """Grid (N tiles, SPLIT_K, M tiles). ws: fp32 [SPLIT_K, M, N] partials, counter: the tiles'
    tickets (``skinny_gemm.store_split_k``). K_SPLIT: a multiple of BLOCK_K (and of DOT_BLOCK_K).
    BLOCK_N: a power of two <= 128 (one row of scale blocks per tile). ACT_Q: W8A8, not with
    BODY_BY_M: the CUDA-core body quantises x per 128-column group itself; the tl.dot body reads
    x as fp8 codes with their scales xs [M, ceil(K/128)] (``act_quant_kernel``).

    BODY_CUDA_CORE / BODY_DOT: that body on BLOCK_N x BLOCK_K tiles (DOT: BLOCK_K <= 128).
    BODY_BY_M (a token count unknown when the launch is built, as in an engine): M <= SMALL_M runs
    the CUDA-core body on BLOCK_N rows x SMALL_M tokens (the grid has one M tile: BLOCK_M >=
    DOT_SMALL_M >= SMALL_M); more tokens run tl.dot on DOT_BLOCK_N x DOT_BLOCK_K tiles of
    DOT_SMALL_M tokens (M <= DOT_SMALL_M) or BLOCK_M tokens, K sliced by DOT_K_SPLIT, by the
    programs whose BLOCK_N-row tile starts a DOT_BLOCK_N-row one (DOT_BLOCK_N a multiple of
    BLOCK_N, <= 128; the others do nothing). SPLIT_K (the grid) covers both slicings: a program
    past its body's last K slice stores a zero partial."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    k0 = pid_k * K_SPLIT
    k_end = tl.minimum(k0 + K_SPLIT, K)
    n0 = pid_n * BLOCK_N
    if BODY == 2:
        if M > SMALL_M:
            if n0 % DOT_BLOCK_N == 0:
                dk0 = pid_k * DOT_K_SPLIT
                dk_end = tl.minimum(dk0 + DOT_K_SPLIT, K)
                if M <= DOT_SMALL_M:
                    _program(x, w, s, y, ws, counter, n0, m0, M, N, dk0, dk_end, stride_xm, stride_wn, stride_sn,
                             stride_ym, pid_n, pid_k, pid_m, SPLIT_K,
                             DOT_SMALL_M, DOT_BLOCK_N, DOT_BLOCK_K, True, REDUCE, DOT_EVEN_K, INTERPRET_DOT, BITS, SCALE_W)
                else:
                    _program(x, w, s, y, ws, counter, n0, m0, M, N, dk0, dk_end, stride_xm, stride_wn, stride_sn,
                             stride_ym, pid_n, pid_k, pid_m, SPLIT_K,
                             BLOCK_M, DOT_BLOCK_N, DOT_BLOCK_K, True, REDUCE, DOT_EVEN_K, INTERPRET_DOT, BITS, SCALE_W)
        else:
            _program(x, w, s, y, ws, counter, n0, m0, M, N, k0, k_end, stride_xm, stride_wn, stride_sn,
                     stride_ym, pid_n, pid_k, pid_m, SPLIT_K,
                     SMALL_M, BLOCK_N, BLOCK_K, False, REDUCE, EVEN_K, INTERPRET_DOT, BITS, SCALE_W)
    else:
        _program(x, w, s, y, ws, counter, n0, m0, M, N, k0, k_end, stride_xm, stride_wn, stride_sn,
                 stride_ym, pid_n, pid_k, pid_m, SPLIT_K,
                 BLOCK_M, BLOCK_N, BLOCK_K, BODY == 1, REDUCE, EVEN_K, INTERPRET_DOT, BITS, SCALE_W, ACT_Q, xs,
                 stride_xsm)


@triton.jit
def fp8_mma_kernel(xq, xs, w, s, y, M, N, K, stride_xm, stride_xsm, stride_wn, stride_sn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Grid (N tiles, M tiles). xq [M, K] fp8, xs [M, ceil(K/128)] f32, w [N, K] fp8,
    s [ceil(N/128), ceil(K/128)] f32; BLOCK_N <= 128 (one weight scale per tile and K block)."""
    BLOCK_K: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    x_ptr = xq + rm[:, None] * stride_xm + offs_k[None, :]
    w_ptr = w + rn[:, None] * stride_wn + offs_k[None, :]
    xs_ptr = xs + rm * stride_xsm
    s_ptr = s + ((pid_n * BLOCK_N) // 128) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptr)
            b = tl.load(w_ptr)
        else:
            kmask = (kb * BLOCK_K + offs_k) < K
            a = tl.load(x_ptr, mask=kmask[None, :], other=0.0)
            b = tl.load(w_ptr, mask=kmask[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b), max_num_imprecise_acc=32)    # [BM, 128] @ [128, BN], fp32
        acc += part * tl.load(xs_ptr + kb)[:, None] * tl.load(s_ptr + kb)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y.dtype.element_ty), mask=out_mask)


ACT_QUANT_GROUPS = 8                # 128-column groups per program of act_quant_kernel


def quantize_activations_triton(x: Tensor, K: int | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (fp8 e4m3 codes [M, K], fp32 scales [M, ceil(K/128)]) in one launch
    (``act_quant_kernel``; the codes of ``plugins.fp8_linear.quantize_activation_groups``). ``K``:
    the weight's (an int; x's own may be a symbol inside ``torch.cond``'s branches), so the codes
    and scales get constant row strides (``fp8_gemm``'s note on strides)."""
    K = K or x.shape[1]
    x = x.contiguous()
    M, G = x.shape[0], triton.cdiv(K, SCALE_BLOCK)
    xq = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((M, G), dtype=torch.float32, device=x.device)
    launcher(act_quant_kernel)[(M, triton.cdiv(G, ACT_QUANT_GROUPS))](
        x, xq, xs, K, G, K, K, G, GROUPS=ACT_QUANT_GROUPS, INTERPRET_DOT=INTERPRET, num_warps=4)
    return xq, xs


MMA_ENV = "DSPARK_FP8_MMA_MIN_M"


def mma_min_m() -> int | None:
    v = os.environ.get(MMA_ENV, "")
    return int(v) if v.strip() else None


def mma_config(M: int, N: int, K: int) -> dict:
    return {"MMA": True, "BLOCK_M": 64 if M <= 64 else 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


# (M bucket, N, K) -> the fastest correct config of benchmarks/fp8_gemm_bench.py on the H200 at 63e95a1
# (benchmarks/results/fp8-gemm-NVIDIA-H200-63e95a1.json.gz: Qwen3-8B, V4-Flash and V4-Pro shapes, M = 1 / 16;
# CUDA-graph replays over rotated weight copies), and at e5bf31b for Qwen3-8B's fused q/k/v and gate/up, o,
# down and k/v at M = 8 / 16 / 64 / 128 with the SCALE_W tiles in the sweep (fp8-gemm-NVIDIA-H200-e5bf31b.json.gz;
# it replaced the 63e95a1 entries of (16, 1024 | 4096, 4096) and (16, 4096, 12288)).
CONFIGS: dict[tuple[int, int, int], dict] = {
    (1, 512, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 512, 7168): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 1024, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 1536, 7168): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 2048, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 3072, 7168): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 4096, 2048): {'BLOCK_N': 16, 'BLOCK_K': 1024, 'num_warps': 4, 'num_stages': 2, 'DOT': False, 'SPLIT_K': 1},
    (1, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 4096, 8192): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 4096, 12288): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 7168, 3072): {'BLOCK_N': 16, 'BLOCK_K': 1024, 'num_warps': 4, 'num_stages': 2, 'DOT': False, 'SPLIT_K': 1},
    (1, 7168, 16384): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 8192, 1024): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 8192, 1536): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 8192, 4096): {'BLOCK_N': 16, 'BLOCK_K': 1024, 'num_warps': 4, 'num_stages': 2, 'DOT': False, 'SPLIT_K': 1},
    (1, 12288, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 16384, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 32768, 1024): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 65536, 1536): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (8, 1024, 4096): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 8},
    (8, 4096, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (8, 4096, 12288): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 16},
    (8, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (8, 24576, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 2},
    (16, 512, 4096): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 16},
    (16, 512, 7168): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 16},
    (16, 1024, 4096): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 8},
    (16, 1536, 7168): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 2048, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 3072, 7168): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 4096, 2048): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 4096, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (16, 4096, 8192): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (16, 7168, 3072): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 7168, 16384): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 8192, 1024): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 8192, 1536): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 8192, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 4, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 12288, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 16384, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 2, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 1},
    (16, 32768, 1024): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (16, 65536, 1536): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (64, 1024, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 8},
    (64, 4096, 4096): {'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 8, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (64, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 8, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (64, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'BLOCK_M': 64, 'SPLIT_K': 4},
    (64, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'BLOCK_M': 64, 'SPLIT_K': 1},
    (128, 1024, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'SPLIT_K': 4},
    (128, 4096, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 4},
    (128, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'BLOCK_M': 128, 'SPLIT_K': 8},
    (128, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'BLOCK_M': 128, 'SPLIT_K': 4},
    (128, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SCALE_W': True, 'BLOCK_M': 128, 'SPLIT_K': 1},
}


def default_config(M: int, N: int, K: int, sms: int = H200_SMS) -> dict:
    """Unmeasured shapes. M <= 2: the CUDA-core body on 16 rows x 512 K (8 KB of fp8 per tile: the
    H200's most frequent winner at M = 1), K split until >= 2 programs per SM while every split
    keeps a whole tile; above: swap-AB tl.dot (64 rows x 128 K, 128 rows for M > 64), split K
    until >= 2 programs per SM, keeping >= 4 K tiles per split. (The CUDA-core body's time grows
    with each token: at M = 4 it took 1.5x the tl.dot tiles', at M = 2 about the same,
    fp8-engine-linear-NVIDIA-H200-9621af9.json.gz.)"""
    if M <= 2:
        bn, bk = 16, 512
        tiles, split = triton.cdiv(N, bn), 1
        while tiles * split < 2 * sms and K // (2 * split) >= bk:
            split *= 2
        return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 3, "DOT": False}
    bn, bk = (128 if M > 64 else 64), 128
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, 64)
    split = 1
    while tiles * split < 2 * sms and K // (2 * split * bk) >= 4:
        split *= 2
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 8 if bn == 128 else 4,
            "num_stages": 4, "DOT": True}


def choose_config(M: int, N: int, K: int) -> dict:
    """The measured config, else the MMA variant where ``DSPARK_FP8_MMA_MIN_M`` <= M, else
    ``default_config``."""
    lo = mma_min_m()
    if lo is not None and M >= lo:
        return mma_config(M, N, K)
    return dict(CONFIGS.get((m_bucket(M), N, K)) or default_config(M, N, K))


def fp8_mma(x: Tensor, w: Tensor, scale: Tensor, cfg: dict, y: Tensor) -> Tensor:
    """The W8A8 variant (module doc) into ``y``."""
    M, (N, K) = x.shape[0], (int(d) for d in w.shape)
    bm, bn = int(cfg.get("BLOCK_M", 64)), int(cfg.get("BLOCK_N", 128))
    if bn > SCALE_BLOCK or pow2(bn) != bn or bm < 16 or pow2(bm) != bm:
        raise ValueError(f"fp8_gemm (MMA): BLOCK_N={bn} must be a power of two <= {SCALE_BLOCK}, "
                         f"BLOCK_M={bm} a power of two >= 16")
    xq, xs = quantize_activations_triton(x, int(w.shape[1]))
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    launcher(fp8_mma_kernel)[grid](
        xq, xs, w, scale, y, M, N, K, xq.stride(0), xs.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, EVEN_K=(K % SCALE_BLOCK == 0), num_warps=int(cfg.get("num_warps", 8)),
        num_stages=int(cfg.get("num_stages", 3)))
    return y


def by_m_config(N: int, K: int) -> dict:
    """One launch for every M (``BODY_BY_M``), for a token count that is symbolic when the launch is
    built (``torch.export`` / AOTInductor with dynamic tokens, ``torch.compile(dynamic=True)``):
    M <= 4 on the CUDA-core tiles and split of M = 1's config (measured, else the default), more
    tokens on the tl.dot tiles and split of M = 16's (16 tokens up to 16, 64 above). Prefill-sized
    M re-reads the weights once per 64 tokens."""
    small = CONFIGS.get((1, N, K)) or default_config(1, N, K)
    dot = CONFIGS.get((16, N, K)) or default_config(16, N, K)
    if small.get("DOT") or not dot.get("DOT", True) or dot.get("MMA") or dot.get("SCALE_W"):
        small, dot = default_config(1, N, K), default_config(16, N, K)
    bn = int(small["BLOCK_N"])
    return {"BY_M": True, "BLOCK_N": bn, "BLOCK_K": int(small["BLOCK_K"]), "SPLIT_K": int(small.get("SPLIT_K", 1)),
            "BLOCK_M": 64, "DOT_BLOCK_N": max(int(dot["BLOCK_N"]), bn), "DOT_BLOCK_K": int(dot["BLOCK_K"]),
            "DOT_SPLIT_K": int(dot.get("SPLIT_K", 1)), "num_warps": int(small.get("num_warps", 4)),
            "num_stages": int(small.get("num_stages", 3))}


TOKEN_BUCKETS = (1, 16, 32, 64, 128)    # launches for a symbolic M that the caller bounds (``bucket_config``)


def bucket_config(bucket: int, N: int, K: int) -> dict:
    """The launch for a symbolic token count that the caller has bounded on the host (an engine's
    ``torch.cond`` on its token count, ``plugins.fp8_linear.fp8_linear_bucketed``). ``bucket`` 1:
    the CUDA-core body with M = 1's config (measured, else the default); 16 and 32 (M <= bucket):
    M = 16's tl.dot config on ``bucket``-token tiles; 64 (M <= 64): M = 64's measured config; 128
    (any M, chosen above 64): M = 128's measured config and token tile. Unmeasured 64 / 128: M =
    16's tiles on 64-token tiles with at most 3 pipeline stages (4 stages of 64-token x tiles cost
    occupancy: 312 against 271 us at M = 64 for two Qwen3-8B layers on the H200,
    fp8-engine-linear-NVIDIA-H200-54dae40.json). Unlike ``by_m_config`` each launch holds one body,
    so none pays for another's registers and shared memory. Any M is computed correctly: the
    bucket only picks the tiles. (The CUDA-core body on 4-token tiles took 1.5x the tl.dot tiles'
    time at M = 4, so 2..16 tokens share the 16-token launch.)"""
    if bucket not in TOKEN_BUCKETS:
        raise ValueError(f"fp8_gemm: bucket={bucket} is not one of {TOKEN_BUCKETS}")
    if bucket == 1:
        cfg = CONFIGS.get((1, N, K)) or default_config(1, N, K)
        return {**(default_config(1, N, K) if cfg.get("DOT") else cfg), "BLOCK_M": 1}
    measured = CONFIGS.get((bucket, N, K)) if bucket >= 64 else None
    if measured and measured.get("DOT") and not measured.get("MMA"):
        return {**measured, "BLOCK_M": int(measured.get("BLOCK_M", 64))}
    cfg = CONFIGS.get((16, N, K)) or default_config(16, N, K)
    cfg = {**(default_config(16, N, K) if not cfg.get("DOT", True) or cfg.get("MMA") else cfg),
           "BLOCK_M": min(bucket, 64)}
    if bucket >= 64:
        cfg["num_stages"] = min(int(cfg.get("num_stages", 3)), 3)
    return cfg


def w8a8_config(cfg: dict, M: int | None, N: int, K: int) -> dict:
    """``cfg`` made fit for ``ACT_Q`` (W8A8): the measured W8A8 config of (M bucket, N, K) where one
    exists (M: the token count or the launch's bucket; None: unknown); else ``cfg``'s tiles with
    ``tl.dot`` tiles of 128 K columns (one activation group) and no ``SCALE_W``, CUDA-core tiles of
    at least 128 K columns. The one-launch (``BY_M``) and separate-kernel (``MMA``) configs are
    replaced by the default for M (16 where M is unknown)."""
    measured = CONFIGS_W8A8.get((m_bucket(M), N, K)) if M is not None else None
    if measured:                                  # a bucket's token tile stays unless the entry sets one
        out = {**({"BLOCK_M": cfg["BLOCK_M"]} if "BLOCK_M" in cfg else {}), **measured}
        if out.get("DOT") and "BLOCK_M" in out:
            out["BLOCK_M"] = max(16, int(out["BLOCK_M"]))
        return out
    if cfg.get("BY_M") or cfg.get("MMA"):
        cfg = default_config(M if M is not None else 16, N, K)
    cfg = {k: v for k, v in cfg.items() if k != "SCALE_W"}
    dot = bool(cfg.get("DOT", M is None or M > 4))
    cfg["BLOCK_K"] = SCALE_BLOCK if dot else max(SCALE_BLOCK, int(cfg["BLOCK_K"]))
    return cfg


# W8A8 (``act_quant``) winners (M bucket, N, K) -> config, from ``benchmarks/fp8_gemm_bench.py --w8a8`` on the
# H200 at 60cd74e (fp8-gemm-NVIDIA-H200-60cd74e.json.gz: Qwen3-8B fused q/k/v and gate/up, o, down at M = 1, 8,
# 16, 64, 128; the time includes act_quant_kernel where the config is a tl.dot one); M = 64 / 128 again at e484ee8
# with ACC_K 128 in the sweep (fp8-gemm-NVIDIA-H200-e484ee8.json.gz; gate/up fused at 64 tokens 36.4 against 46.6 us).
CONFIGS_W8A8: dict[tuple[int, int, int], dict] = {
    (1, 4096, 4096): {'BLOCK_N': 16, 'BLOCK_K': 1024, 'num_warps': 4, 'num_stages': 2, 'DOT': False, 'SPLIT_K': 1},
    (1, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 8},
    (1, 6144, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 8},
    (1, 24576, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 2},
    (8, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 4},
    (8, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 8},
    (8, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 4},
    (8, 24576, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 2},
    (16, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 4},
    (16, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 8},
    (16, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 16, 'SPLIT_K': 4},
    (16, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 4, 'DOT': True},
    (64, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 64, 'SPLIT_K': 4},
    (64, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 64, 'SPLIT_K': 8, 'ACC_K': 128},
    (64, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 64, 'SPLIT_K': 4, 'ACC_K': 128},
    (64, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'SPLIT_K': 1, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'ACC_K': 128},
    (128, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 128, 'SPLIT_K': 4, 'ACC_K': 128},
    (128, 4096, 12288): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 128, 'SPLIT_K': 8, 'ACC_K': 128},
    (128, 6144, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'BLOCK_M': 128, 'SPLIT_K': 4, 'ACC_K': 128},
    (128, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4, 'DOT': True, 'BLOCK_M': 128, 'SPLIT_K': 1, 'ACC_K': 128},
}


def fp8_gemm(x: Tensor, w: Tensor, scale: Tensor, config: dict | None = None, out: Tensor | None = None,
             bucket: int = 0, act_quant: bool = False) -> Tensor:
    """``x[M, K] @ (w[N, K] * scale)^T`` -> ``[M, N]`` in x.dtype. ``config``: see the module doc
    (None: ``bucket_config(bucket)`` when a bucket is given, else ``choose_config``, or
    ``by_m_config`` when M is symbolic). N and K are taken from the weight (x's K may be a
    symbolic expression under ``torch.compile(dynamic=True)``). ``act_quant``: W8A8, x quantised
    per (token, 128-column group) to fp8 e4m3 (``ACT_Q``: by ``act_quant_kernel`` before a tl.dot
    launch, by the CUDA-core body itself; the chosen config is adapted by ``w8a8_config`` unless
    ``config`` is given)."""
    M, Kx = x.shape
    N, K = (int(d) for d in w.shape)    # a weight's sizes are fixed; traced inside torch.cond they are symbols
    if Kx != K:
        raise ValueError(f"fp8_gemm: x has K={Kx}, w has K={K}")
    # Row strides go to the kernels as the weight's K (an int): x is made contiguous, so its row
    # stride is K. Inside ``torch.cond``'s branches under ``torch.compile(dynamic=True)`` x's sizes
    # and strides are symbols, and a symbolic stride compiles without Triton's divisible-by-16
    # hint (no vectorised loads of x: 2x the kernel time at 8 tokens in the compiled W8A8 step,
    # profile-compiled-w8a8-b1-c5bb067).
    w, x, scale = w.contiguous(), x.contiguous(), scale.contiguous()
    if config is not None:
        cfg = dict(config)
    elif bucket:
        cfg = bucket_config(bucket, N, K)
    else:
        cfg = choose_config(M, N, K) if isinstance(M, int) else by_m_config(N, K)
    if act_quant and config is None:
        cfg = w8a8_config(cfg, bucket or (M if isinstance(M, int) else None), N, K)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if cfg.get("MMA"):
        return y if M * N == 0 else fp8_mma(x, w, scale, cfg, y)

    bn, bk, split = int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"]), int(cfg.get("SPLIT_K", 1))
    by_m = bool(cfg.get("BY_M", False))
    dot = not by_m and bool(cfg.get("DOT", M > 4))
    dot_bn, dot_bk = int(cfg.get("DOT_BLOCK_N", 64)), int(cfg.get("DOT_BLOCK_K", SCALE_BLOCK))
    scale_w = bool(cfg.get("SCALE_W", False))
    if act_quant and (by_m or scale_w or (bk != SCALE_BLOCK if dot else bk % SCALE_BLOCK)
                      or int(cfg.get("ACC_K", 32)) not in (32, 64, 128)):
        raise ValueError(f"fp8_gemm (act_quant): config {cfg} does not fit W8A8: tl.dot tiles need BLOCK_K = "
                         f"{SCALE_BLOCK} without SCALE_W, CUDA-core tiles a multiple of {SCALE_BLOCK}, no BY_M; "
                         f"ACC_K (columns per fp32 addition of the fp8 dots) 32, 64 or 128")
    if bn > SCALE_BLOCK or pow2(bn) != bn or pow2(bk) != bk or (dot and bk > SCALE_BLOCK and not scale_w):
        raise ValueError(f"fp8_gemm: BLOCK_N={bn} must be a power of two <= {SCALE_BLOCK}, BLOCK_K={bk} a "
                         f"power of two (<= {SCALE_BLOCK} with DOT, unless SCALE_W)")
    if by_m and not (bn <= dot_bn <= SCALE_BLOCK and pow2(dot_bn) == dot_bn and dot_bk <= SCALE_BLOCK
                     and pow2(dot_bk) == dot_bk and int(cfg.get("BLOCK_M", 64)) >= BY_M_DOT_SMALL):
        raise ValueError(f"fp8_gemm (BY_M): DOT_BLOCK_N={dot_bn} must be a power of two in [BLOCK_N={bn}, "
                         f"{SCALE_BLOCK}], DOT_BLOCK_K={dot_bk} a power of two <= {SCALE_BLOCK}, BLOCK_M >= "
                         f"{BY_M_DOT_SMALL}")
    if by_m or not isinstance(M, int):           # a symbolic M: the config's token tile as is
        bm = pow2(int(cfg.get("BLOCK_M", 64)))
        if dot and bm < 16:
            raise ValueError(f"fp8_gemm: BLOCK_M={bm} must be >= 16 with DOT")
    else:
        bm_cap = int(cfg.get("BLOCK_M", 64))
        bm = max(16, min(pow2(M), pow2(bm_cap))) if dot else min(pow2(M), pow2(bm_cap))
    if isinstance(M, int) and M * N == 0:
        return y
    if by_m:        # the two bodies slice K their own ways in one grid of the larger split count
        k_split, n_small = SplitK.slices(K, bk, split)
        dot_k_split, n_dot = SplitK.slices(K, dot_bk, int(cfg.get("DOT_SPLIT_K", split)))
        plan = SplitK.plan(M, N, K, bm, bn, bk, max(n_small, n_dot), cfg.get("REDUCE", "ticket"), x.device,
                           k_split=k_split)
    else:
        plan = SplitK.plan(M, N, K, bm, bn, bk, split, cfg.get("REDUCE", "ticket"), x.device)
        dot_k_split = plan.k_split
    body = BODY_BY_M if by_m else (BODY_DOT if dot else BODY_CUDA_CORE)
    xs = scale                                   # unused unless the tl.dot body takes quantised x
    xs_stride = 0
    if act_quant and dot:
        x, xs = quantize_activations_triton(x, K)
        xs_stride = triton.cdiv(K, SCALE_BLOCK)
    y_stride = N if out is None else y.stride(0)
    launcher(fp8_gemm_kernel)[plan.grid](
        x, w, scale, y, plan.ws, plan.counter, M, N, K, plan.k_split, plan.split, K, K,
        int(scale.shape[1]), y_stride, dot_k_split, xs, xs_stride, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BODY=body,
        REDUCE=plan.reduce, EVEN_K=(K % bk == 0), INTERPRET_DOT=INTERPRET, BITS=bool(cfg.get("BITS", False)),
        SMALL_M=BY_M_SMALL, DOT_SMALL_M=BY_M_DOT_SMALL, DOT_BLOCK_N=dot_bn, DOT_BLOCK_K=dot_bk,
        DOT_EVEN_K=(K % dot_bk == 0), SCALE_W=scale_w, ACT_Q=int(cfg.get("ACC_K", 32)) if act_quant else 0,
        num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 4)))
    return plan.finish(y)
