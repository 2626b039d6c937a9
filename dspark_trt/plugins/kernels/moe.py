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

The launcher sums ``out`` over the k slots in fp32 (skipped slots count 0) and rounds once. Launch
choices depend only on static sizes when traced with a dynamic M (``torch.export``).

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
from .common import launcher


@triton.jit
def _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M: tl.constexpr):
    """-> (pair ids [BLOCK_M] (-1 pad), local expert of the block (-1: unused block))."""
    b = tl.program_id(0)
    pair = tl.load(sorted_pairs + b * BLOCK_M + tl.arange(0, BLOCK_M))
    lead = tl.load(sorted_pairs + b * BLOCK_M)                 # a used block starts with a real pair
    e = tl.load(expert_ids + tl.maximum(lead, 0)).to(tl.int64) - first_expert
    return pair, tl.where(lead >= 0, e, -1)


@triton.jit
def moe_gate_up_kernel(x, expert_ids, routing_weights, w13, sorted_pairs, act, first_expert, limit,
                       D, H, K, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (blocks, cdiv(H, BLOCK_N)); x [M, D], w13 [E, 2H, D], act [M*K, H]."""
    pair, e = _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M)
    if e >= 0:
        live = pair >= 0
        tok = tl.where(live, pair // K, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        base = w13 + e * 2 * H * D
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < D
            xt = tl.load(x + tok[:, None] * D + kk[None, :], mask=live[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            g = tl.load(base + n[None, :].to(tl.int64) * D + kk[:, None], mask=wmask, other=0.0)      # [BK, BN]
            u = tl.load(base + (H + n[None, :]).to(tl.int64) * D + kk[:, None], mask=wmask, other=0.0)
            acc_g = tl.dot(xt, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(xt, u, acc_u, input_precision="ieee")
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
def moe_down_kernel(act, expert_ids, w2, sorted_pairs, out, first_expert, D, H,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (blocks, cdiv(D, BLOCK_N)); act [M*K, H], w2 [E, D, H], out [M*K, D]."""
    pair, e = _block_expert(sorted_pairs, expert_ids, first_expert, BLOCK_M)
    if e >= 0:
        live = pair >= 0
        row = tl.maximum(pair, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < D
        base = w2 + e * D * H
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < H
            a = tl.load(act + row[:, None] * H + kk[None, :], mask=live[:, None] & kmask[None, :], other=0.0)
            w = tl.load(base + n[None, :].to(tl.int64) * H + kk[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)                          # [BK, BN]
            acc = tl.dot(a, w, acc, input_precision="ieee")
        tl.store(out + row[:, None] * D + n[None, :], acc.to(out.dtype.element_ty),
                 mask=live[:, None] & nmask[None, :])


@triton.jit
def moe_experts_token_kernel(x, expert_ids, routing_weights, w13, w2, out, first_expert, E, D, H, K,
                             LIMIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Grid (M, cdiv(D, BLOCK_D)); same rounding points as the grouped kernels."""
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
                    kmask = kk < D
                    xv = tl.load(x + m * D + kk, mask=kmask, other=0.0).to(tl.float32)
                    wmask = hmask[:, None] & kmask[None, :]
                    rows = e * 2 * H + hh
                    wg = tl.load(w13 + rows[:, None].to(tl.int64) * D + kk[None, :], mask=wmask, other=0.0)
                    wu = tl.load(w13 + (rows + H)[:, None].to(tl.int64) * D + kk[None, :], mask=wmask, other=0.0)
                    g += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
                    u += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
                g = g.to(x.dtype.element_ty).to(tl.float32)
                u = u.to(x.dtype.element_ty).to(tl.float32)
                if LIMIT > 0:
                    g = tl.minimum(g, LIMIT)
                    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
                a = (g / (1.0 + tl.exp(-g)) * u * wt).to(x.dtype.element_ty).to(tl.float32)
                w = tl.load(w2 + (e * D + dcol)[:, None].to(tl.int64) * H + hh[None, :],
                            mask=dmask[:, None] & hmask[None, :], other=0.0)
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
                       num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """Same contract as ``moe_experts_ref``; unset launch parameters from ``MOE_DEFAULTS``."""
    cfg = {**MOE_DEFAULTS, **{k: v for k, v in dict(block_m=block_m, block_n=block_n, block_k=block_k,
                                                      num_warps=num_warps, num_stages=num_stages).items()
                              if v is not None}}
    M, D = x.shape
    k = expert_ids.shape[1]
    E, H = w13.shape[0], w2.shape[2]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    x, ids = x.contiguous(), expert_ids.contiguous()
    sorted_pairs = align_by_expert(ids, first_expert, E, bm)
    blocks = num_blocks(M * k, E, bm)
    act = torch.empty((M * k, H), dtype=x.dtype, device=x.device)
    out = torch.empty((M * k, D), dtype=x.dtype, device=x.device)
    opts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    launcher(moe_gate_up_kernel)[(blocks, triton.cdiv(H, bn))](
        x, ids, routing_weights.contiguous(), w13.contiguous(), sorted_pairs, act, int(first_expert),
        float(swiglu_limit), D, H, k, HAS_LIMIT=swiglu_limit > 0, **opts)
    launcher(moe_down_kernel)[(blocks, triton.cdiv(D, bn))](
        act, ids, w2.contiguous(), sorted_pairs, out, int(first_expert), D, H, **opts)
    live = local_experts(ids, first_expert, E)[1]                                   # [M, k]
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.where(live[..., None], out.view(M, k, D).to(acc), 0.0).sum(1).to(x.dtype)
