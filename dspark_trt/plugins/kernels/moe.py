"""Triton kernels of ``dspark::moe_experts``: grouped expert GEMMs over the chosen experts only.

The M*k (token, slot) pairs are grouped by local expert (``align_by_expert``, torch ops on the
device, no host sync): each expert's run of pair ids is padded with -1 to a multiple of BLOCK_M,
in a buffer of static size ``BLOCK_M * (cdiv(M*k, BLOCK_M) + min(M*k, E))`` (every used expert
adds at most one partial block). A program owns one BLOCK_M block of one expert's run and one
BLOCK_N column tile, so each chosen expert's weight tile is read once per block of its tokens;
blocks past the used ones (leading entry -1) exit at once.

* ``moe_gate_up_kernel``: ``[x_rows] @ [gate; up]^T`` (fp32 accumulation, rounded to x's dtype
  like the eager matmul), ``silu(min(gate, L)) * clamp(up, -L, L) * routing weight`` in fp32,
  rounded to x's dtype -> ``act [M*k, h]`` at the pair's row.
* ``moe_down_kernel``: ``act_rows @ w2^T`` -> ``out [M*k, d]`` (x's dtype) at the pair's row.

Weight format (``FORMAT``, a constexpr of every kernel; ``load_weight`` reads a tile): ``DENSE``
weights in x's dtype, or ``MXFP4`` (``dspark::moe_experts_mxfp4``): packed E2M1 nibbles
``[rows, cols/2]`` (low nibble = even column) with one E8M0 exponent byte per 32 columns
``[rows, cols/32]``, decoded in registers (nibble split, E2M1 by integer arithmetic, times
``2^(e - 127)`` built from the exponent bits) into x's dtype, exact for bf16 / fp32, then the same
``tl.dot``: only the chosen experts' packed bytes are read. ``DOT_SCALED`` (MXFP4 with bf16 / fp16
x, the op's default: 5-8x faster than the in-register decode on the H200, where Triton emulates
the scaled MMA) hands the packed tile and its scales to ``tl.dot_scaled`` instead.

The launcher sums ``out`` over the k slots in fp32 (skipped slots count 0) and rounds once. Launch
choices depend only on static sizes when traced with a dynamic M (``torch.export``).

``schedule_experts`` picks between these grouped kernels and the GEMV decode schedule of
``moe_decode.py`` (a few tokens: no padding to MMA tiles, no sort); both compute the same rounding
points.

``moe_experts_token_kernel`` is the one-launch schedule without workspace for the TensorRT AOT
plugin: a program per (token, BLOCK_D output columns) runs its k experts as GEMVs, recomputing
the token's gate/up for each column tile (correct, not fast: each expert's w13 is read once per
column tile and token).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..expert_ids import local_experts
from . import moe_decode
from .common import DENSE, MXFP4, launcher

MX_GROUP = tl.constexpr(32)               # columns per E8M0 scale


@triton.jit
def e2m1_to_float(code):
    """E2M1 codes (int32 0..15, bit 3 the sign) -> float32 0, .5, 1, 1.5, 2, 3, 4, 6 (and negatives)."""
    ex, man = (code >> 1) & 3, code & 1
    twice = tl.where(ex == 0, man, (2 + man) << tl.maximum(ex - 1, 0))          # 2|v|: 0 1 2 3 4 6 8 12
    return tl.where((code & 8) != 0, -twice, twice).to(tl.float32) * 0.5


@triton.jit
def e8m0_to_float(e):
    """E8M0 exponent bytes (int32) -> float32 2^(e - 127), the exponent field itself (0 -> 0)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_weight(w, w_scale, rows, rmask, c0, ncols, OUT: tl.constexpr, FORMAT: tl.constexpr,
                BLOCK_C: tl.constexpr, TRANS: tl.constexpr):
    """``W[rows, c0 : c0 + BLOCK_C]`` of a row-major weight of ``ncols`` logical columns, 0 outside:
    [R, BLOCK_C], or its transpose [BLOCK_C, R] with TRANS. DENSE: ``w`` holds the values (w_scale
    unused); MXFP4: ``w [rows, ncols/2]`` E2M1 pairs, ``w_scale [rows, ncols/32]`` E8M0, -> OUT."""
    cols = c0 + tl.arange(0, BLOCK_C)
    cmask = cols < ncols
    r64 = rows.to(tl.int64)
    if FORMAT == DENSE:
        if TRANS:
            tile = tl.load(w + r64[None, :] * ncols + cols[:, None], mask=cmask[:, None] & rmask[None, :], other=0.0)
        else:
            tile = tl.load(w + r64[:, None] * ncols + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    else:
        half = c0 // 2 + tl.arange(0, BLOCK_C // 2)
        b = tl.load(w + r64[:, None] * (ncols // 2) + half[None, :],
                    mask=rmask[:, None] & (half < ncols // 2)[None, :], other=0).to(tl.int32)   # [R, BC/2]
        code = tl.reshape(tl.join(b & 15, (b >> 4) & 15), [rows.shape[0], BLOCK_C])     # column 2j + nibble
        e = tl.load(w_scale + r64[:, None] * (ncols // MX_GROUP) + cols[None, :] // MX_GROUP,
                    mask=rmask[:, None] & cmask[None, :], other=0).to(tl.int32)          # [R, BC]
        tile = (e2m1_to_float(code) * e8m0_to_float(e)).to(OUT)
        if TRANS:
            tile = tl.trans(tile)
    return tile


@triton.jit
def dot_weight(a, acc, w, w_scale, rows, rmask, c0, ncols, FORMAT: tl.constexpr, DOT_SCALED: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """``acc + a @ W[rows, c0 : c0 + BLOCK_C]^T``: a [BM, BLOCK_C] in x's dtype, acc [BM, R] fp32."""
    if DOT_SCALED:
        half = c0 // 2 + tl.arange(0, BLOCK_C // 2)
        r64 = rows.to(tl.int64)
        b = tl.load(w + r64[None, :] * (ncols // 2) + half[:, None],
                    mask=(half < ncols // 2)[:, None] & rmask[None, :], other=0).to(tl.uint8, bitcast=True)
        g = c0 // MX_GROUP + tl.arange(0, BLOCK_C // MX_GROUP)
        e = tl.load(w_scale + r64[:, None] * (ncols // MX_GROUP) + g[None, :],
                    mask=rmask[:, None] & (g < ncols // MX_GROUP)[None, :], other=0).to(tl.uint8, bitcast=True)
        fmt: tl.constexpr = "bf16" if a.dtype == tl.bfloat16 else "fp16"
        acc = tl.dot_scaled(a, None, fmt, b, e, "e2m1", acc)                          # b [BC/2, R], e [R, BC/32]
    else:
        wt = load_weight(w, w_scale, rows, rmask, c0, ncols, a.dtype, FORMAT, BLOCK_C, True)   # [BC, R]
        acc = tl.dot(a, wt, acc, input_precision="ieee")
    return acc


@triton.jit
def _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M: tl.constexpr):
    """-> (pair ids [BLOCK_M] (-1 pad), local expert of the block (-1: unused block))."""
    b = tl.program_id(0)
    pair = tl.load(sorted_pairs + b * BLOCK_M + tl.arange(0, BLOCK_M))
    lead = tl.load(sorted_pairs + b * BLOCK_M)                 # a used block starts with a real pair
    e = tl.load(expert_ids + tl.maximum(lead, 0)).to(tl.int64) - first_expert
    return pair, tl.where(lead >= 0, e, -1)


@triton.jit
def moe_gate_up_kernel(x, expert_ids, routing_weights, w13, w13_scale, sorted_pairs, act, first_expert, limit,
                       D, H, K, HAS_LIMIT: tl.constexpr, FORMAT: tl.constexpr, DOT_SCALED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (blocks, cdiv(H, BLOCK_N)); x [M, D], w13 [E, 2H, D] (MXFP4: [E, 2H, D/2] + scales
    [E, 2H, D/32]), act [M*K, H]."""
    pair, e = _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M)
    if e >= 0:
        live = pair >= 0
        tok = tl.where(live, pair // K, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        rows = e * 2 * H + n                                     # gate rows; up rows are H further
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + tok[:, None] * D + kk[None, :], mask=live[:, None] & (kk < D)[None, :], other=0.0)
            acc_g = dot_weight(xt, acc_g, w13, w13_scale, rows, nmask, k0, D, FORMAT, DOT_SCALED, BLOCK_K)
            acc_u = dot_weight(xt, acc_u, w13, w13_scale, rows + H, nmask, k0, D, FORMAT, DOT_SCALED, BLOCK_K)
        gate = acc_g.to(x.dtype.element_ty).to(tl.float32)       # the eager matmul's rounding
        up = acc_u.to(x.dtype.element_ty).to(tl.float32)
        if HAS_LIMIT:
            lim = tl.cast(limit, tl.float32)      # AOTInductor passes Python floats as fp64 (Triton 3.6)
            gate = tl.minimum(gate, lim)
            up = tl.minimum(tl.maximum(up, -lim), lim)
        wt = tl.load(routing_weights + tl.maximum(pair, 0), mask=live, other=0.0).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up * wt[:, None]
        out = act + tl.maximum(pair, 0).to(tl.int64)[:, None] * H + n[None, :]
        tl.store(out, h.to(act.dtype.element_ty), mask=live[:, None] & nmask[None, :])


@triton.jit
def moe_down_kernel(act, expert_ids, w2, w2_scale, sorted_pairs, out, first_expert, D, H, FORMAT: tl.constexpr,
                    DOT_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (blocks, cdiv(D, BLOCK_N)); act [M*K, H], w2 [E, D, H] (MXFP4: [E, D, H/2] + scales
    [E, D, H/32]), out [M*K, D]."""
    pair, e = _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M)
    if e >= 0:
        live = pair >= 0
        row = tl.maximum(pair, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < D
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act + row[:, None] * H + kk[None, :], mask=live[:, None] & (kk < H)[None, :], other=0.0)
            acc = dot_weight(a, acc, w2, w2_scale, e * D + n, nmask, k0, H, FORMAT, DOT_SCALED, BLOCK_K)
        tl.store(out + row[:, None] * D + n[None, :], acc.to(out.dtype.element_ty),
                 mask=live[:, None] & nmask[None, :])


@triton.jit
def moe_experts_token_kernel(x, expert_ids, routing_weights, w13, w13_scale, w2, w2_scale, out, first_expert,
                             E, D, H, K, LIMIT: tl.constexpr, FORMAT: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (M, cdiv(D, BLOCK_D)); same rounding points as the grouped kernels (weights as there)."""
    m = tl.program_id(0).to(tl.int64)
    dcol = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dcol < D
    y = tl.zeros([BLOCK_D], tl.float32)
    for j in range(K):
        gid = tl.load(expert_ids + m * K + j).to(tl.int64)
        e = gid - first_expert
        if (gid >= 0) & (e >= 0) & (e < E):
            wt = tl.load(routing_weights + m * K + j).to(tl.float32)
            slot = tl.zeros([BLOCK_D], tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                hmask = hh < H
                g = tl.zeros([BLOCK_H], tl.float32)
                u = tl.zeros([BLOCK_H], tl.float32)
                for k0 in range(0, D, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    xv = tl.load(x + m * D + kk, mask=kk < D, other=0.0).to(tl.float32)
                    rows = e * 2 * H + hh
                    wg = load_weight(w13, w13_scale, rows, hmask, k0, D, x.dtype.element_ty, FORMAT, BLOCK_K, False)
                    wu = load_weight(w13, w13_scale, rows + H, hmask, k0, D, x.dtype.element_ty, FORMAT, BLOCK_K,
                                     False)
                    g += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
                    u += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
                g = g.to(x.dtype.element_ty).to(tl.float32)
                u = u.to(x.dtype.element_ty).to(tl.float32)
                if LIMIT > 0:
                    g = tl.minimum(g, LIMIT)
                    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
                a = (g / (1.0 + tl.exp(-g)) * u * wt).to(x.dtype.element_ty).to(tl.float32)
                w = load_weight(w2, w2_scale, e * D + dcol, dmask, h0, H, x.dtype.element_ty, FORMAT, BLOCK_H, False)
                slot += tl.sum(w.to(tl.float32) * a[None, :], 1)
            y += slot.to(x.dtype.element_ty).to(tl.float32)
    tl.store(out + m * D + dcol, y.to(out.dtype.element_ty), mask=dmask)


def num_blocks(pairs, num_experts: int, block_m: int):
    """Static upper bound of used BLOCK_M blocks (a SymInt when ``pairs`` is one)."""
    return (pairs + block_m - 1) // block_m + torch.sym_min(pairs, num_experts)


def align_by_expert(expert_ids: Tensor, first_expert: int, num_experts: int, block_m: int) -> Tensor:
    """expert_ids [M, k] -> sorted_pairs [num_blocks * block_m] int32: pair ids ``m * k + j``
    grouped by local expert (ascending, then by pair id), each expert's run padded with -1 to a
    multiple of block_m, unused blocks -1. Skipped pairs (-1 / other ranks' experts) are left out."""
    local, live = local_experts(expert_ids.reshape(-1), first_expert, num_experts)
    P, E, dev = local.numel(), num_experts, local.device
    key = torch.where(live, local, E)                                        # skipped pairs sort last
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded                             # padded run of each expert
    first = torch.cumsum(counts, 0) - counts                                 # its first sorted pair
    order = torch.argsort(key, stable=True)
    skey = key[order]
    S = num_blocks(P, E, block_m) * block_m
    dest = run_start[skey.clamp(max=E - 1)] + torch.arange(P, device=dev) - first[skey]
    dest = torch.where(skey < E, dest, S)                                    # skipped -> dump slot S
    out = torch.full((S + 1,), -1, dtype=torch.int32, device=dev)
    return out.scatter(0, dest, order.to(torch.int32))[:S]


# Defaults: 16 rows (the smallest tl.dot tile: decode blocks hold a few tokens per expert),
# 64 x 64 weight tiles. Not tuned on a GPU yet: benchmarks/build_gpu.py v4-eager times alternatives.
MOE_DEFAULTS = dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)


def moe_experts_triton(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: Tensor, w2: Tensor,
                       first_expert: int, swiglu_limit: float, block_m: int | None = None,
                       block_n: int | None = None, block_k: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None,
                       schedule: str = "auto", pdl: bool | None = None, k_stages: int | None = None) -> Tensor:
    """Same contract as ``moe_experts_ref``; unset launch parameters from ``MOE_DEFAULTS`` (grouped)
    or ``moe_decode.decode_tile``; ``schedule`` as ``schedule_experts``; ``pdl``, ``k_stages``: the decode
    schedule's (``moe_decode.decode_experts``)."""
    launch = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                  pdl=pdl, k_stages=k_stages)
    return schedule_experts(x, expert_ids, routing_weights, (w13, None), (w2, None), first_expert, swiglu_limit,
                            w2.shape[2], schedule, launch)


def moe_experts_mxfp4_triton(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13_packed: Tensor,
                             w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, first_expert: int,
                             swiglu_limit: float, dot_scaled: bool = False, schedule: str = "auto",
                             **launch) -> Tensor:
    """Same contract as ``moe_experts_mxfp4_ref``; ``dot_scaled``: the grouped kernels' inner product
    by ``tl.dot_scaled`` on the packed tiles (bf16 / fp16 x, block_k a multiple of 32); ``schedule``
    as ``schedule_experts``."""
    block_k = launch.get("block_k") or MOE_DEFAULTS["block_k"]
    if dot_scaled and (x.dtype not in (torch.bfloat16, torch.float16) or block_k % 32):
        raise ValueError(f"moe_experts_mxfp4: dot_scaled needs bf16 / fp16 x and block_k a multiple of 32 "
                         f"(x {x.dtype}, block_k {block_k})")
    return schedule_experts(x, expert_ids, routing_weights, (w13_packed, w13_scale), (w2_packed, w2_scale),
                            first_expert, swiglu_limit, 2 * w2_packed.shape[2], schedule,
                            {**launch, "dot_scaled": dot_scaled})


# launch keys that only the decode schedule takes (``moe_decode.decode_experts``), beside the tile it shares
DECODE_ONLY = {"decode", "pdl", "maxnreg", "k_stages"}


def schedule_experts(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: tuple, w2: tuple,
                     first_expert: int, swiglu_limit: float, H: int, schedule: str, launch: dict) -> Tensor:
    """``schedule``: "grouped" (``grouped_experts``), "decode" (``moe_decode.decode_experts``: GEMVs
    per (token, slot) pair), or "auto": decode for a small concrete pair count
    (``moe_decode.use_decode``) unless launch parameters are given (``dot_scaled`` and ``decode``
    aside: each applies when auto picks its schedule)."""
    if schedule not in ("auto", "grouped", "decode"):
        raise ValueError(f"moe_experts: schedule must be auto, grouped or decode, got {schedule!r}")
    given = {k for k, v in launch.items() if v is not None and v is not False}
    prefs = {"dot_scaled"} | DECODE_ONLY             # each schedule's own choices: kept for when it runs
    if schedule == "auto":
        small = moe_decode.use_decode(x, expert_ids, dense=w13[1] is None)
        schedule = "decode" if small and not given - prefs else "grouped"
        given -= prefs
    foreign = given & ({"block_m", "num_stages", "dot_scaled"} if schedule == "decode" else DECODE_ONLY)
    if foreign:
        raise ValueError(f"moe_experts: {sorted(foreign)} do not apply to the {schedule} schedule")
    if schedule == "decode":
        keys = ("block_n", "block_k", "num_warps", *sorted(DECODE_ONLY))
        return moe_decode.decode_experts(x, expert_ids, routing_weights, w13, w2, first_expert, swiglu_limit, H,
                                         **{k: launch.get(k) for k in keys})
    return grouped_experts(x, expert_ids, routing_weights, w13, w2, first_expert, swiglu_limit, H=H,
                           **{k: v for k, v in launch.items() if k not in DECODE_ONLY})


def grouped_experts(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: tuple, w2: tuple,
                    first_expert: int, swiglu_limit: float, H: int, dot_scaled: bool = False,
                    **launch) -> Tensor:
    """The two grouped launches and the slot sum; ``w13`` / ``w2``: (values, None) dense or
    (packed, E8M0 scales) MXFP4; H the intermediate size."""
    cfg = {**MOE_DEFAULTS, **{k: v for k, v in launch.items() if v is not None}}
    M, D = x.shape
    k = expert_ids.shape[1]
    E = w13[0].shape[0]
    dense = w13[1] is None
    fmt = int((DENSE if dense else MXFP4).value)         # a plain int constexpr: AOTI wraps the launch
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    x, ids = x.contiguous(), expert_ids.contiguous()
    w13_v, w2_v = w13[0].contiguous(), w2[0].contiguous()
    w13_s, w2_s = (w13_v, w2_v) if dense else (w13[1].contiguous(), w2[1].contiguous())  # dense: unread
    sorted_pairs = align_by_expert(ids, first_expert, E, bm)
    blocks = num_blocks(M * k, E, bm)
    act = torch.empty((M * k, H), dtype=x.dtype, device=x.device)
    out = torch.empty((M * k, D), dtype=x.dtype, device=x.device)
    opts = dict(FORMAT=fmt, DOT_SCALED=bool(dot_scaled), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    launcher(moe_gate_up_kernel)[(blocks, triton.cdiv(H, bn))](
        x, ids, routing_weights.contiguous(), w13_v, w13_s, sorted_pairs, act, int(first_expert),
        float(swiglu_limit), D, H, k, HAS_LIMIT=swiglu_limit > 0, **opts)
    launcher(moe_down_kernel)[(blocks, triton.cdiv(D, bn))](
        act, ids, w2_v, w2_s, sorted_pairs, out, int(first_expert), D, H, **opts)
    live = local_experts(ids, first_expert, E)[1]                                   # [M, k]
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.where(live[..., None], out.view(M, k, D).to(acc), 0.0).sum(1).to(x.dtype)
