"""Few-token decode GEMV: 2..``MAX_ROWS`` tokens (a verify block, a draft block, a small batch)
with ``decode_gemv``'s fused prologues, split-K and a deferred norm scale (issue #21).

``y[M, N] = p(x)[M, K] @ W[N, K]^T``, bf16 in and out, fp32 accumulation; ``p`` is ``"none"``
(``h = x + residual``), ``"rmsnorm"`` or ``"swiglu"`` as in ``decode_gemv``. The weights dominate
(M <= 16 tokens of activations against N x K weights), so the kernel streams W once:

* Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: a program owns ``BLOCK_N`` weight rows and one ``K /
  SPLIT_K`` slice of K. Split-K gives the narrow projections (o, down, q/k/v) enough programs at
  the wide tiles the tensor cores want (session 28 on the H200: the previous body, one program per
  16 rows and the whole K, ran the 8-token verify at 2x the module's time).
* Each K tile loads a ``[BLOCK_N, BLOCK_K]`` weight tile and the tokens' ``[BLOCK_M, BLOCK_K]``
  prologue values; ``DOT``: one ``tl.dot`` ("swap AB": the weights the MMA's wide side, the tokens
  padded to 16 by repeating the last), else per token a multiply-reduce on the CUDA cores.
* RMSNorm's scale is deferred: the program multiplies ``bf16(h * g)`` and sums ``h^2`` of its K
  slice on the way; the scale ``rsqrt(sum h^2 / K + eps)`` of each token multiplies the finished
  fp32 sums (after the split-K reduction). So no program reads all of K twice for a mean square,
  which made the prologue, not the weights, the cost of every program. The one rounding is of
  ``h * g`` instead of the module's ``h * rstd * g``: the result is within about one bf16 ulp of
  the module's, no longer bit for bit its roundings (the one-token kernel keeps them).
* Split-K partials are reduced deterministically (``skinny_gemm``'s ticket: the tile's last
  program sums them in split order, with the sums of squares); a traced call (export) runs
  unsplit, since the ticket's cached counters must not hold fake tensors.
* The residual sum ``h`` is written by the programs of the first N tile (each its K slice).
* fp8 e4m3 weights with 128 x 128 block scales (``decode_gemv``'s module doc): BLOCK_N divides 128,
  the prologue's values are multiplied by their columns' scales after the sums of squares.
  Tile options of the tensor-core body that save the e4m3 -> bf16 conversion's instructions, each
  tile's one block scale applied to its fp32 product: ``F16``, fp16 operands (``_dot_f16``); ``X8``,
  the fp8 tensor cores on the codes as they are, the activations split into two e4m3 terms (``_dot_x8``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...atomic_write import write_text_atomic
from .common import INTERPRET, col_scale, gdc_launch_dependents, gdc_wait, launcher, num_sms, residual_sum, \
    round_bf16, swiglu_bf16, ticket_counters, tracing
from .skinny_gemm import default_config as default_skinny_config, m_bucket

NONE, RMSNORM, SWIGLU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)    # decode_gemv.PROLOGUES
F16_XSCALE = tl.constexpr(2.0 ** -8)     # fp8 tiles with fp16 operands (``F16``): the activations' factor
FP8_MMA_CODES = {None: 0, "F16": 1, "X8": 2}   # the kernel's FP8_MMA: bf16 operands, or a tile option's
# (M bucket, N, K) -> tile: winners of ``benchmarks/decode_rows_sweep.py`` on the H200 at 40cfc72
# (benchmarks/results/decode-rows-NVIDIA-H200-40cfc72.json.gz; with the shape's prologue, CUDA-graph
# replays over weight copies past L2; "modules": the torch prologue + F.linear); others:
# ``default_config``. Per-GPU tables measured on other GPUs ship in ``tables/`` (``TABLES``:
# ``decode-rows-<torch.cuda.get_device_name, spaces as ->.json``, written from a sweep's result by
# ``benchmarks/ship_decode_rows_table.py``): on the first lookup for a CUDA device (``tile_for``;
# nothing at import) the table of that GPU's name is read and its shapes win over these. The H100's
# one-token tiles took the Qwen3-8B AR step on an H100 from 6.105 to 5.766 ms (7915627); its 2..8-token
# ones (9985f8c) its batch-1 verify from 6.906 to 6.823 ms, while its 16-token winners took the batch-16 AR
# step from 7.108 to 7.641 ms inside the chain, so bucket 16 keeps these (5f1aa1d). Session 49 replaced the
# H100's one- and eight-token rows by sweeps of the wider space (``ship_table(..., keep=True)``): the AR step
# through ``LLM`` 5.742 -> 5.671 ms, the verify 6.681 -> 6.543, the draft 1.479 -> 1.439. The H200's own table
# (session 48, a sweep of one and eight tokens with more one-token tiles, launches and splits, 61d9ae4)
# took the AR step through ``LLM`` at batch 1 from 4.616 to 4.303 ms and the verify from 5.183 to 5.006
# against these and ``decode_gemv.CONFIGS`` in the same call; its other buckets keep these. fp8 weights' rows
# (``weight_bytes`` 1) sit beside the bf16 ones: the H200's for one and eight tokens (session 57), the H100's for
# one, eight and 16 (session 58, the F16 / X8 tiles winning at 8 and 16: verify 7.994 -> 4.916 ms). CPU and the
# interpreter: these only. ``DSPARK_DECODE_ROWS_TABLE`` (or ``load_table``) replaces this table by
# sweep JSONs and turns the per-GPU tables off: an explicit table wins.
CONFIGS: dict[tuple[int, int, int], dict] = {
    # qkv [6144, 4096], rmsnorm, M = 2/4/8/16:
    #   this 18.7/19.0/19.6/19.8 us | cuBLAS alone 16.1/15.6/15.7/16.0 | modules 33.1/37.4/39.6/43.3
    (2, 6144, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (4, 6144, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (8, 6144, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, DOT=True, num_warps=4, num_stages=4),
    (16, 6144, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, DOT=True, num_warps=4, num_stages=4),
    # o [4096, 4096], none, M = 2/4/8/16:
    #   this 13.0/13.3/13.6/13.1 us | cuBLAS alone 12.5/12.4/12.4/12.7 | modules 12.5/12.4/12.4/12.7
    (2, 4096, 4096): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, DOT=False, num_warps=4, num_stages=3),
    (4, 4096, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (8, 4096, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, DOT=True, num_warps=8, num_stages=4),
    (16, 4096, 4096): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, DOT=True, num_warps=4, num_stages=4),
    # gate_up [24576, 4096], rmsnorm, M = 2/4/8/16:
    #   this 57.5/57.5/56.7/55.5 us | cuBLAS alone 51.3/51.1/54.9/51.6 | modules 71.7/73.0/79.2/79.0
    (2, 24576, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
    (4, 24576, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
    (8, 24576, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, DOT=True, num_warps=4, num_stages=3),
    (16, 24576, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, DOT=True, num_warps=4, num_stages=4),
    # down [4096, 12288], swiglu, M = 2/4/8/16:
    #   this 31.1/31.4/31.9/32.7 us | cuBLAS alone 29.5/29.6/30.1/28.9 | modules 36.8/37.1/37.2/36.2
    (2, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=8, num_stages=4),
    (4, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=8, num_stages=4),
    (8, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=8, num_stages=4),
    (16, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=8, num_stages=4),
    # lm_head [151936, 4096], rmsnorm, M = 2/4/8/16:
    #   this 306.3/309.3/307.8/309.4 us | cuBLAS alone 297.4/298.9/300.2/303.1 | modules 319.6/322.3/325.5/332.3
    (2, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
    (4, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
    (8, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
    (16, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
}
TABLE_ENV = "DSPARK_DECODE_ROWS_TABLE"
TABLES = Path(__file__).with_name("tables")                 # the per-GPU tables (package data)
GPU_TABLES = True                   # whether tile_for reads them (False once a table is loaded explicitly)
_gpu_tables: dict[str, dict] = {}                           # GPU name -> its table ({}: none shipped)


@triton.jit
def _prologue(xp, rp, rop, g, offs, K, ss, pid_n, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
              STORE_RES: tl.constexpr, AXIS: tl.constexpr):
    """(the bf16 values the weights multiply at columns ``offs``, before RMSNorm's scale, as fp32;
    ss + the sum of h^2 over them along AXIS). xp / rp / rop: x / residual / residual_out rows."""
    if PROLOGUE == SWIGLU:                                   # x = [gate | up]
        return swiglu_bf16(xp, K, offs), ss
    h = residual_sum(xp, rp, rop, offs, K, pid_n, HAS_RES, STORE_RES)     # the first N tile stores it
    if PROLOGUE == RMSNORM:
        return round_bf16(h * tl.load(g + offs).to(tl.float32)), ss + tl.sum(h * h, AXIS)
    return h, ss


@triton.jit
def _cuda_core_tile(x, res, res_out, g, wt, offs, sk, acc, ss, cols, K, XK, pid_n, PROLOGUE: tl.constexpr,
                    HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, ROWS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + per token m the fp32 weight tile wt times its prologue values (times
    the columns' fp8 block scales sk, ``col_scale``)."""
    for m in tl.static_range(ROWS):
        xin, s = _prologue(x + m * XK, res + m * K, res_out + m * K, g, offs, K, 0.0, pid_n, PROLOGUE, HAS_RES,
                           STORE_RES, 0)
        acc += tl.where(cols[None, :] == m, tl.sum(wt * (xin * sk)[None, :], 1)[:, None], 0.0)
        ss += tl.where(cols == m, s, 0.0)
    return acc, ss


@triton.jit
def _dot(wt, xin, acc, INTERPRET_DOT: tl.constexpr):
    """acc + wt [BLOCK_N, BK] @ xin [BLOCK_M, BK]^T in bf16 (wt: bf16, or fp8 e4m3: exact in bf16; xin
    holds bf16 values, or with fp8 weights their products with the block scales, rounded here); under
    the interpreter in fp32 (its bf16 ``tl.dot`` is wrong, as ``skinny_gemm`` notes)."""
    if INTERPRET_DOT:
        return tl.dot(wt.to(tl.float32), tl.trans(xin), acc, input_precision="ieee")
    return tl.dot(wt.to(tl.bfloat16), tl.trans(xin.to(tl.bfloat16)), acc)


@triton.jit
def _dot_f16(wt, xin, acc, scale, nb, stride_sn, kt, INTERPRET_DOT: tl.constexpr):
    """acc + s * (wt [BLOCK_N, BK] @ xin [BLOCK_M, BK]^T) for an fp8 e4m3 tile of one block of scales
    (s: that block's, the tile's first column ``kt``; BK divides 128) with fp16 operands: e4m3 -> f16
    is one instruction per two weights where bf16 takes about four per weight (sm_90 SASS, session 57).
    xin enters times ``F16_XSCALE`` (2^-8; fp16 holds |xin| < 1.7e7, rounded to 11 bits above 2^-6,
    to 2^-17 below), the fp32 product leaves times s / ``F16_XSCALE``; the interpreter rounds xin to
    fp16 the same way and multiplies in fp32."""
    s = tl.load(scale + nb * stride_sn + kt // 128) * (1.0 / F16_XSCALE)
    x16 = (xin * F16_XSCALE).to(tl.float16)
    if INTERPRET_DOT:
        part = tl.dot(wt.to(tl.float32), tl.trans(x16.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(wt.to(tl.float16), tl.trans(x16))
    return acc + part * s


@triton.jit
def _dot_x8(wt, xin, acc, scale, nb, stride_sn, kt, INTERPRET_DOT: tl.constexpr):
    """``_dot_f16``'s product on the fp8 tensor cores with the e4m3 codes as they are: each token's
    values (bf16: 8 significant bits) over a power of two p (below 256 for the tile's largest) split
    into hi, their top 4 bits (truncated), and lo, the rest times 16, both e4m3: x = p (hi + lo / 16),
    exact where |x| >= 2^-13 of the token's largest in the tile (below, to 2^-20 of it); two fp8 x fp8
    dots, added into fp32 every 32 columns. The interpreter multiplies the same codes in fp32."""
    b = tl.max(tl.abs(xin), 1).to(tl.int32, bitcast=True)                       # [BM] the largest's bits
    e = tl.minimum(tl.maximum(((b >> 23) & 0xFF) - 7, 1), 253)                  # p's biased exponent
    p = (e << 23).to(tl.float32, bitcast=True)
    y = xin * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]           # x / p, exact: |y| < 256
    hi = ((y.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)).to(tl.float8e4nv)
    lo = ((y - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    if INTERPRET_DOT:
        w32 = wt.to(tl.float32)
        part = (tl.dot(w32, tl.trans(hi.to(tl.float32)), input_precision="ieee")
                + tl.dot(w32, tl.trans(lo.to(tl.float32)), input_precision="ieee") * 0.0625)
    else:
        part = (tl.dot(wt, tl.trans(hi), max_num_imprecise_acc=32)
                + tl.dot(wt, tl.trans(lo), max_num_imprecise_acc=32) * 0.0625)
    return acc + part * (p[None, :] * tl.load(scale + nb * stride_sn + kt // 128))


@triton.jit
def _dot_tile(wt, xin, acc, scale, nb, stride_sn, kt, cols, SCALED: tl.constexpr, FP8_MMA: tl.constexpr,
              INTERPRET_DOT: tl.constexpr):
    """The tensor-core body's step: acc + the weight tile wt (first column ``kt``, columns ``cols``)
    times the prologue values xin, on the operands ``FP8_MMA`` names (``decode_rows_kernel``)."""
    if FP8_MMA == 1:
        return _dot_f16(wt, xin, acc, scale, nb, stride_sn, kt, INTERPRET_DOT)
    if FP8_MMA == 2:
        return _dot_x8(wt, xin, acc, scale, nb, stride_sn, kt, INTERPRET_DOT)
    return _dot(wt, xin * col_scale(scale, nb, stride_sn, cols, SCALED), acc, INTERPRET_DOT)


@triton.jit
def _scaled(acc, ss, K, eps, PROLOGUE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] times each token's RMSNorm scale (ss: its sum of h^2 over all K)."""
    if PROLOGUE == RMSNORM:
        return acc * tl.rsqrt((ss / K + eps).to(tl.float32))[None, :]      # eps may arrive as fp64 (AOTI)
    return acc


@triton.jit
def decode_rows_kernel(x, res, res_out, g, w, y, scale, ws, ss_ws, counter, N, K, K_SPLIT, SPLIT_K, stride_wn,
                       stride_sn, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                       PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, PDL: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr, TICKET: tl.constexpr,
                       INTERPRET_DOT: tl.constexpr, PREFETCH: tl.constexpr, K_STAGES: tl.constexpr = 1,
                       SCALED: tl.constexpr = False, FP8_MMA: tl.constexpr = 0):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K). x [ROWS, K] ([ROWS, 2K] for SWIGLU), res / res_out
    [ROWS, K], g [K], w [N, K] (row stride ``stride_wn``), y [ROWS, N]. SCALED: w in fp8 e4m3 with
    fp32 block scales ``scale`` (row stride ``stride_sn``; BLOCK_N divides 128), as in
    ``decode_gemv_kernel``: the prologue's values (after the sums of squares) times their columns'
    scales. TICKET (SPLIT_K > 1): ws fp32 [SPLIT_K, ROWS, N] partials, ss_ws fp32 [N tiles, SPLIT_K,
    BLOCK_M] sums of squares (RMSNORM), counter int32 [N tiles] zeros. With PDL the successor is let go first and the predecessor
    waited for after the first ``PRE_K`` weight columns are loaded. PREFETCH (CUDA-core body): the
    loop's next weight tile is loaded before the current one is reduced (the same sums, in order).
    K_STAGES > 1 (CUDA-core body): its weight loop pipelined through shared memory by Triton
    (``decode_gemv_kernel``'s K_STAGES; the DOT body's loop is pipelined by ``num_stages``). FP8_MMA
    (DOT, SCALED, BLOCK_K and PRE_K dividing 128): 1 fp16 operands (``_dot_f16``), 2 e4m3 operands
    (``_dot_x8``), each tile's scale on its product; 0 bf16 operands."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)              # clamped rows: loads need no N mask
    nb = pid_n * BLOCK_N // 128                              # the rows' block of scales (SCALED)
    k0 = pid_k * K_SPLIT
    if PDL:
        gdc_launch_dependents()
    rp = k0 + tl.arange(0, PRE_K)
    w0 = tl.load(w + rn[:, None] * stride_wn + rp[None, :])
    if PDL:
        gdc_wait()
    XK = 2 * K if PROLOGUE == SWIGLU else K                  # x's row stride
    rk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_M)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DOT:
        rm = tl.minimum(cols, ROWS - 1)[:, None]
        xr, rr, ro = x + rm * XK, res + rm * K, res_out + rm * K                    # [BLOCK_M, 1]
        xin, ss = _prologue(xr, rr, ro, g, rp[None, :], K, ss, pid_n, PROLOGUE, HAS_RES, STORE_RES, 1)
        acc = _dot_tile(w0, xin, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), scale, nb, stride_sn, k0,
                        rp[None, :], SCALED, FP8_MMA, INTERPRET_DOT)
        for k in range(k0 + PRE_K, k0 + K_SPLIT, BLOCK_K):
            wt = tl.load(w + rn[:, None] * stride_wn + (k + rk)[None, :])
            xin, ss = _prologue(xr, rr, ro, g, (k + rk)[None, :], K, ss, pid_n, PROLOGUE, HAS_RES, STORE_RES, 1)
            acc = _dot_tile(wt, xin, acc, scale, nb, stride_sn, k, (k + rk)[None, :], SCALED, FP8_MMA, INTERPRET_DOT)
    else:
        last = k0 + K_SPLIT - BLOCK_K                       # prefetches past the split reload its last tile
        if PREFETCH:
            wt = tl.load(w + rn[:, None] * stride_wn + (tl.minimum(k0 + PRE_K, last) + rk)[None, :])
        acc, ss = _cuda_core_tile(x, res, res_out, g, w0.to(tl.float32), rp,
                                  col_scale(scale, nb, stride_sn, rp, SCALED), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
                                  ss, cols, K, XK, pid_n, PROLOGUE, HAS_RES, STORE_RES, ROWS)
        for k in tl.range(k0 + PRE_K, k0 + K_SPLIT, BLOCK_K, num_stages=K_STAGES):
            if PREFETCH:
                cur = wt
                wt = tl.load(w + rn[:, None] * stride_wn + (tl.minimum(k + BLOCK_K, last) + rk)[None, :])
            else:
                cur = tl.load(w + rn[:, None] * stride_wn + (k + rk)[None, :])
            acc, ss = _cuda_core_tile(x, res, res_out, g, cur.to(tl.float32), k + rk,
                                      col_scale(scale, nb, stride_sn, k + rk, SCALED), acc, ss, cols, K, XK, pid_n,
                                      PROLOGUE, HAS_RES, STORE_RES, ROWS)
    mask = (offs_n < N)[:, None] & (cols < ROWS)[None, :]
    y_ptr = y + cols[None, :] * N + offs_n[:, None]
    if TICKET:
        part = cols[None, :] * N + offs_n[:, None]            # [ROWS, N] offsets inside one split
        tl.store(ws + pid_k * ROWS * N + part, acc, mask=mask)
        ss_tile = ss_ws + pid_n * SPLIT_K * BLOCK_M + cols
        if PROLOGUE == RMSNORM:
            tl.store(ss_tile + pid_k * BLOCK_M, ss)
        tl.debug_barrier()                                   # every thread's partial is stored
        if tl.atomic_add(counter + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:    # the tile's last program
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):                         # split order: deterministic
                total += tl.load(ws + s * ROWS * N + part, mask=mask, other=0.0, cache_modifier=".cg")
                if PROLOGUE == RMSNORM:
                    ss += tl.load(ss_tile + s * BLOCK_M, cache_modifier=".cg")
            tl.store(y_ptr, _scaled(total, ss, K, eps, PROLOGUE).to(y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter + pid_n, 0)               # reset for the next launch
    else:
        tl.store(y_ptr, _scaled(acc, ss, K, eps, PROLOGUE).to(y.dtype.element_ty), mask=mask)


def default_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """Unmeasured shapes: ``skinny_gemm.default_config`` (the tensor cores from 5 tokens, K split
    while the programs are fewer than 2 per SM), BLOCK_K cut to a power of two dividing K."""
    cfg = default_skinny_config(M, N, K, sms)
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], K & -K)
    return cfg


def choose_config(M: int, N: int, K: int, device: torch.device, fp8: bool = False) -> dict:
    """The measured tile of (M bucket, N, K) (``tile_for``), else ``default_config`` for the
    device's SMs."""
    return dict(tile_for(M, N, K, device, fp8) or default_config(M, N, K, num_sms(device)))


def table_key(bucket: int, N: int, K: int, weight_bytes: int = 2) -> tuple:
    """A table's key: (M bucket, N, K), and for tiles measured on fp8 weights (a sweep's rows of
    ``weight_bytes`` 1, ``decode_rows_sweep.py --fp8``) (M bucket, N, K, 1)."""
    return (bucket, N, K) if weight_bytes == 2 else (bucket, N, K, weight_bytes)


def tile_for(M: int, N: int, K: int, device: torch.device, fp8: bool = False) -> dict | None:
    """The measured tile of (M bucket, N, K) on ``device`` (a copy), or None: the shipped table of
    the device's GPU (a CUDA device, ``GPU_TABLES`` on), else ``CONFIGS``; for ``fp8`` weights
    their own tile first (``table_key``), else the bf16 weights'."""
    name = gpu_name(device) if GPU_TABLES else None
    table = gpu_table(name) if name else {}
    for key in ([table_key(m_bucket(M), N, K, 1)] if fp8 else []) + [table_key(m_bucket(M), N, K)]:
        cfg = table.get(key) or CONFIGS.get(key)
        if cfg:
            return dict(cfg)
    return None


_names: dict[int, str] = {}


def gpu_name(device: torch.device) -> str | None:
    """``torch.cuda.get_device_name`` of a CUDA device (cached per index), None for any other."""
    device = torch.device(device)
    if device.type != "cuda" or INTERPRET:
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _names:
        _names[index] = torch.cuda.get_device_name(index)
    return _names[index]


def table_path(name: str) -> Path:
    """Where the shipped table of the GPU called ``name`` lives (it may not exist)."""
    return TABLES / f"decode-rows-{name.replace(' ', '-')}.json"


def gpu_table(name: str) -> dict:
    """The shipped table of the GPU called ``name`` ({} where none ships), read once. A table that
    is not one, or is another GPU's, raises ValueError naming the file."""
    if name not in _gpu_tables:
        path = table_path(name)
        table, gpu = _read(path) if path.exists() else ({}, name)
        if table and gpu != name:
            raise ValueError(f"decode-rows table {str(path)!r}: its gpu is not {name!r}")
        _gpu_tables[name] = table
    return _gpu_tables[name]


def read_table(path) -> dict:
    """(M bucket, N, K) -> tile of a ``decode_rows_sweep.py`` JSON or a shipped table (``rows`` of
    ``bucket``, ``N``, ``K``, ``best_config``); ValueError naming the file where it is neither."""
    return _read(path)[0]


def _read(path) -> tuple[dict, str | None]:
    """``read_table``'s table and the file's ``gpu`` (None where it names none), one read."""
    try:
        doc = json.loads(Path(path).read_text())
        return {table_key(int(r["bucket"]), int(r["N"]), int(r["K"]), int(r.get("weight_bytes", 2))):
                dict(r["best_config"]) for r in doc["rows"] if r.get("best_config")}, doc.get("gpu")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"decode-rows table {str(path)!r}: not a decode_rows_sweep.py result ({e})") from e


def load_table(*paths: str) -> int:
    """Replace ``CONFIGS`` by the winners of ``decode_rows_sweep.py`` JSONs or shipped tables (a
    later file's shape over an earlier's: e.g. a sweep of M = 2..16 and one of M = 1) and turn the
    per-GPU tables off (``GPU_TABLES``); returns how many. Raises ValueError naming the file that
    is not such a result (``CONFIGS`` unchanged)."""
    global GPU_TABLES
    table = {}
    for path in paths:
        table.update(read_table(path))
    CONFIGS.clear(), CONFIGS.update(table)
    GPU_TABLES = False
    return len(table)


def ship_table(result: str | os.PathLike, out_dir: str | os.PathLike = TABLES, buckets=None,
               keep: bool = False) -> Path:
    """Write a ``decode_rows_sweep.py`` result (``.json`` or ``.json.gz``) as the shipped table of
    its GPU (``table_path``): its shapes' keys and winners (of the token ``buckets`` only, where
    given: the others keep ``CONFIGS``' tiles, or with ``keep`` the rows of the GPU's table in
    ``out_dir``, whose head is kept as ``kept_from``), and where they came from (git sha, GPU, the
    result's file name, the sweep's command, the buckets). ValueError naming the file that is not
    a result, or the table kept that is another GPU's."""
    import gzip
    result = Path(result)
    try:
        raw = result.read_bytes()
        doc = json.loads(gzip.decompress(raw) if result.suffix == ".gz" else raw)
        rows = [{"shape": r.get("shape"), "bucket": int(r["bucket"]), "N": int(r["N"]), "K": int(r["K"]),
                 **({"weight_bytes": 1} if r.get("weight_bytes") == 1 else {}),
                 "best_config": dict(r["best_config"])} for r in doc["rows"]
                if r.get("best_config") and (buckets is None or int(r["bucket"]) in buckets)]
        gpu = str(doc["gpu"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"decode-rows table {str(result)!r}: not a decode_rows_sweep.py result ({e})") from e
    head = {"gpu": gpu, "git_sha": doc.get("git_sha"), "source": result.name, "command": doc.get("command")}
    if buckets is not None:
        head["buckets"] = sorted(int(b) for b in buckets)
    path = Path(out_dir) / table_path(gpu).name
    if keep and buckets is not None and path.exists():
        old = json.loads(path.read_text())
        if old.get("gpu") != gpu:
            raise ValueError(f"decode-rows table {str(path)!r}: its gpu is not {gpu!r}, the result's")
        kinds = {r.get("weight_bytes", 2) for r in rows}           # fp8 rows replace fp8 rows only
        kept = [r for r in old["rows"] if int(r["bucket"]) not in head["buckets"]
                or r.get("weight_bytes", 2) not in kinds]
        head["kept_buckets"] = sorted({int(r["bucket"]) for r in kept})
        head["kept_from"] = {k: v for k, v in old.items() if k != "rows"}
        order = {name: i for i, name in enumerate(dict.fromkeys(r.get("shape") for r in kept + rows))}
        rows = sorted(kept + rows, key=lambda r: (order[r.get("shape")], int(r["bucket"])))
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines += [' "rows": ['] + [f"  {json.dumps(r)}," for r in rows]
    lines[-1] = lines[-1].rstrip(",")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "{\n" + "\n".join(lines) + "\n ]\n}\n")      # the old table or the new


def decode_rows(x: Tensor, w: Tensor, y: Tensor, prologue: int, res: Tensor, res_out: Tensor, g: Tensor, eps: float,
                has_res: bool, store_res: bool, w_scale: Tensor | None, cfg: dict, pre_k: int | None,
                launch: dict) -> Tensor:
    """Launch for x [M, K'] (checked by ``decode_gemv``) into y [M, N]; ``w_scale``: fp8 w's contiguous
    block scales (BLOCK_N fit to them by ``decode_gemv``), None for bf16 w; ``cfg``: a tile (module
    doc; ``SPLIT_K`` cut to what K allows, 1 when traced)."""
    M = int(x.shape[0])
    N, K = (int(d) for d in w.shape)
    bn, bk = int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    dot = bool(cfg.get("DOT", M > 4))
    split = 1 if tracing() else int(cfg.get("SPLIT_K", 1))
    while split > 1 and K % (split * bk):
        split //= 2
    pre = int(pre_k or bk)
    k_split = K // split
    if pre > k_split or k_split % pre or pre % bk:
        raise ValueError(f"decode_gemv: pre_k={pre} must be a multiple of BLOCK_K={bk} within K / SPLIT_K = {k_split}")
    options = [o for o in ("F16", "X8") if cfg.get(o)]
    if len(options) > 1 or (options and not (dot and w_scale is not None and 128 % bk == 0 and 128 % pre == 0)):
        raise ValueError(f"decode_gemv: F16 (fp16 operands) and X8 (e4m3 operands) are tile options of fp8 "
                         f"weights' tensor-core body with BLOCK_K and pre_k dividing 128, one at a time, got "
                         f"{options}, DOT={dot}, weights {'fp8' if w_scale is not None else str(w.dtype)}, "
                         f"BLOCK_K={bk}, pre_k={pre}")
    bm = triton.next_power_of_2(M)
    if dot:                                                  # tl.dot tiles are at least 16 x 16
        bm, bn = max(16, bm), max(16, bn)
    tiles = triton.cdiv(N, bn)
    if split > 1:
        ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        ss_ws = torch.empty(tiles, split, bm, dtype=torch.float32, device=x.device) if prologue == RMSNORM.value else ws
        counter = ticket_counters(x.device, tiles)
    else:
        ws = ss_ws = counter = y
    scaled = w_scale is not None
    launcher(decode_rows_kernel)[(tiles, split)](
        x, res, res_out, g, w, y, w_scale if scaled else w, ws, ss_ws, counter, N, K, k_split, split, K,
        w_scale.stride(0) if scaled else 0, eps, BLOCK_N=bn, BLOCK_K=bk, PRE_K=pre, PROLOGUE=prologue, HAS_RES=has_res,
        STORE_RES=store_res, PDL=bool(launch), ROWS=M, BLOCK_M=bm, DOT=dot, TICKET=split > 1,
        INTERPRET_DOT=dot and INTERPRET, PREFETCH=not dot and bool(cfg.get("PREFETCH")),
        K_STAGES=1 if dot else int(cfg.get("K_STAGES", 1)), SCALED=scaled,
        FP8_MMA=FP8_MMA_CODES[options[0] if options else None],
        num_warps=int(cfg.get("num_warps", 4)),
        num_stages=int(cfg.get("num_stages", 3)), **launch)
    return y


if os.environ.get(TABLE_ENV):                               # one file, or several joined by os.pathsep
    load_table(*os.environ[TABLE_ENV].split(os.pathsep))
