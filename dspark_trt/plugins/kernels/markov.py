"""Triton kernels of ``dspark::markov_sample`` (exact, full vocabulary) and
``dspark::markov_sample_topk`` (fast, candidate-restricted proposal).

Exact mode. Step k reads W2 [V, r] once for *all* rows: the vocabulary is split into BLOCK_V tiles
dealt round-robin to C programs; a program computes ``z = U_k + W1[prev] @ W2_tile^T`` for every
row (``tl.dot``, fp32 accumulation), stores z, scores it (``z`` at T = 0, else ``z / T + Gumbel``)
and keeps its best (score, index) per row. The token of step k is the reduction of the C partials
(ties -> smallest index, like ``torch.argmax``). Two launch schedules share one kernel:

* ``one_launch=True``: a persistent grid (C <= number of SMs, all programs resident) runs the N
  steps with a grid-wide barrier (atomic counter) between steps. On GPU only C <= SM count is safe.
* ``one_launch=False``: one launch per step (each program first reduces the previous step's
  partials to get ``prev``) plus a final one-program launch that writes the last token.

Fast mode: see ``markov_sample_topk_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, STREAM_DRAFT, gumbel, launcher, pow2, row_key


@triton.jit
def _reduce_partials(part_val, part_idx, k, rows, rmask, B, C, BLOCK_C: tl.constexpr):
    """Token of step k for each row: argmax over the C per-program partials [N, B, C]."""
    cc = tl.arange(0, BLOCK_C)
    off = (k * B + rows)[:, None] * C + cc[None, :]
    m = rmask[:, None] & (cc[None, :] < C)
    val = tl.load(part_val + off, mask=m, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(part_idx + off, mask=m, other=2147483647, cache_modifier=".cg")
    best = tl.max(val, 1)
    return tl.min(tl.where(val == best[:, None], idx, 2147483647), 1)


@triton.jit
def _markov_step(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c, C, N, V, R,
                 stride_ub, stride_uk, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Step k over the vocabulary tiles c, c + C, ...: store z, return the best (score, index)."""
    best = tl.full([BLOCK_B], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_B], tl.int32)
    rr0 = tl.arange(0, BLOCK_R)
    for tile in range(c, tl.cdiv(V, BLOCK_V), C):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        cmask = cols < V
        acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + rr0
            rm = rr < R
            h = tl.load(w1 + prev[:, None] * R + rr[None, :],
                        mask=live[:, None] & rm[None, :], other=0.0)                  # [BLOCK_B, BLOCK_R]
            w = tl.load(w2 + cols.to(tl.int64)[:, None] * R + rr[None, :],
                        mask=cmask[:, None] & rm[None, :], other=0.0)                 # [BLOCK_V, BLOCK_R]
            acc += tl.dot(h.to(w.dtype), tl.trans(w), input_precision="ieee")
        m2 = live[:, None] & cmask[None, :]
        u = tl.load(U + rows.to(tl.int64)[:, None] * stride_ub + k * stride_uk + cols[None, :],
                    mask=m2, other=0.0).to(tl.float32)
        z = u + acc                                                                    # bias first, like the reference
        tl.store(z_out + (rows.to(tl.int64) * N + k)[:, None] * V + cols[None, :],
                 tl.where(m2, z, 0.0), mask=rmask[:, None] & cmask[None, :])
        score = tl.where(greedy[:, None], z, z * inv_t[:, None] + gumbel(key[:, None], cols[None, :]))
        score = tl.where(cmask[None, :], score, float("-inf"))
        tmax = tl.max(score, 1)
        targ = tile * BLOCK_V + tl.argmax(score, 1, tie_break_left=True)
        arg = tl.where(tmax > best, targ, arg)
        best = tl.maximum(best, tmax)
    return best, arg


@triton.jit
def _row_params(anchor, temperature, seed, start, rows, rmask):
    anc = tl.load(anchor + rows, mask=rmask, other=-1)
    live = rmask & (anc >= 0)
    temp = tl.load(temperature + rows, mask=rmask, other=0.0).to(tl.float32)
    greedy = temp <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(temp, 1e-6))
    sd = tl.load(seed + rows, mask=rmask, other=0)
    st = tl.load(start + rows, mask=rmask, other=0)
    return anc, live, greedy, inv_t, sd, st


@triton.jit
def markov_sample_kernel(U, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                         part_val, part_idx, counter,
                         B, N, V, R, C, K0, K1, stride_ub, stride_uk,
                         BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, GRID_SYNC: tl.constexpr, WRITE_LAST: tl.constexpr):
    """Grid (C, row groups); steps K0..K1-1; partials [N, B, C]."""
    c = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    anc, live, greedy, inv_t, sd, st = _row_params(anchor, temperature, seed, start, rows, rmask)
    for k in range(K0, K1):
        if k == 0:
            prev = tl.maximum(anc, 0).to(tl.int64)
        else:
            prev = _reduce_partials(part_val, part_idx, k - 1, rows, rmask, B, C, BLOCK_C).to(tl.int64)
            if c == 0:
                tl.store(tokens_out + rows * N + (k - 1), tl.where(live, prev, -1), mask=rmask)
        key = row_key(sd, st + k + 1, STREAM_DRAFT)                                   # [BLOCK_B]
        best, arg = _markov_step(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c,
                                 C, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
        poff = (k * B + rows) * C + c
        tl.store(part_val + poff, best, mask=rmask)
        tl.store(part_idx + poff, arg, mask=rmask)
        tl.debug_barrier()                                   # partials visible to the whole program
        if GRID_SYNC:                                        # ... and to every program of the grid
            total = C * tl.num_programs(1)
            tl.atomic_add(counter, 1, sem="release")
            seen = tl.atomic_add(counter, 0, sem="acquire")
            while seen < total * (k + 1):
                seen = tl.atomic_add(counter, 0, sem="acquire")
            tl.debug_barrier()
    if WRITE_LAST:
        if c == 0:
            last = _reduce_partials(part_val, part_idx, N - 1, rows, rmask, B, C, BLOCK_C)
            tl.store(tokens_out + rows * N + (N - 1), tl.where(live, last, -1).to(tl.int64), mask=rmask)


@triton.jit
def markov_rows_kernel(U, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                       B, N, V, R, stride_ub, stride_uk,
                       BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (row groups,): one program runs all N steps of its rows over the whole vocabulary;
    ``prev`` stays in registers, so no scratch memory (the TensorRT AOT schedule)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    anc, live, greedy, inv_t, sd, st = _row_params(anchor, temperature, seed, start, rows, rmask)
    prev = tl.maximum(anc, 0).to(tl.int64)
    for k in range(0, N):
        key = row_key(sd, st + k + 1, STREAM_DRAFT)
        best, arg = _markov_step(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, 0,
                                 1, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
        tl.store(tokens_out + rows * N + k, tl.where(live, arg, -1).to(tl.int64), mask=rmask)
        prev = arg.to(tl.int64)


def default_num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def markov_sample_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                         seed: Tensor, start: Tensor, one_launch: bool = True, rows_only: bool = False,
                         num_programs: int | None = None, block_v: int = 128,
                         block_r: int = 64, num_warps: int | None = None, num_stages: int = 3) -> tuple[Tensor, Tensor]:
    """Exact full-vocabulary Markov sampler; same contract as ``markov_sample_ref``.

    The grid is (C, ceil(B / 64)): C programs split the vocabulary, axis 1 splits the rows.
    ``num_programs`` (C) defaults to the SM count; with ``one_launch`` the whole grid must be
    resident at once (the grid barrier would dead-lock otherwise), so C is divided by the number
    of row groups. ``rows_only`` runs ``markov_rows_kernel`` instead (one program per row group,
    the schedule of the TensorRT AOT plugin)."""
    B, N, V = U.shape
    Rk = w1.shape[1]
    dev = U.device
    tokens = torch.empty((B, N), dtype=torch.int64, device=dev)
    z = torch.empty((B, N, V), dtype=torch.float32, device=dev)
    if B == 0 or N == 0:
        return tokens, z
    if U.stride(-1) != 1:
        U = U.contiguous()
    block_b = min(pow2(B, 16), 64)
    groups = triton.cdiv(B, block_b)
    w1c, w2c = (w1.contiguous(), w2.contiguous()) if Rk else (U, U)   # rank 0 (DFlash): never read
    if rows_only:
        launcher(markov_rows_kernel)[(groups,)](
            U, anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(),
            start.contiguous(), z, tokens, B, N, V, Rk, U.stride(0), U.stride(1), BLOCK_B=block_b,
            BLOCK_V=block_v, BLOCK_R=min(block_r, pow2(Rk, 16)), num_warps=num_warps or 4,
            num_stages=num_stages)
        return tokens, z
    C = num_programs or default_num_programs(dev)
    if one_launch:
        C = max(1, C // groups)
    if one_launch and INTERPRET:                # the interpreter runs programs one after another
        C, one_launch = 1, groups == 1
    part_val = torch.empty((N, B, C), dtype=torch.float32, device=dev)
    part_idx = torch.empty((N, B, C), dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    common = dict(BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=min(block_r, pow2(Rk, 16)),
                  BLOCK_C=pow2(C), num_warps=num_warps or (4 if block_b <= 16 else 8),
                  num_stages=num_stages)
    args = (U, anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(),
            start.contiguous(), z, tokens, part_val, part_idx, counter, B, N, V, Rk, C)
    kernel = launcher(markov_sample_kernel)
    if one_launch:
        kernel[(C, groups)](*args, 0, N, U.stride(0), U.stride(1), GRID_SYNC=True, WRITE_LAST=True, **common)
    else:
        for k in range(N):
            kernel[(C, groups)](*args, k, k + 1, U.stride(0), U.stride(1), GRID_SYNC=False, WRITE_LAST=False,
                         **common)
        kernel[(1, groups)](*args, N, N, U.stride(0), U.stride(1), GRID_SYNC=False, WRITE_LAST=True, **common)
    return tokens, z


# ---------------------------------------------------------------------------------------------
# Fast mode: a candidate-restricted proposal (NOT the exact full-vocabulary sampler).


@triton.jit
def markov_candidates_kernel(U, cand_out, V, N, stride_ub, stride_uk, M: tl.constexpr,
                             CHUNK: tl.constexpr):
    """Per (row, step, vocabulary chunk): the chunk's M largest base logits (ties -> smaller index),
    -1 where the chunk has fewer than M finite entries. cand_out [B, N, num_chunks * M] int32."""
    bk = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bk // N
    k = bk % N
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(U + b.to(tl.int64) * stride_ub + k * stride_uk + cols, mask=cols < V,
                other=float("-inf")).to(tl.float32)
    out = cand_out + (bk.to(tl.int64) * tl.num_programs(1) + chunk) * M
    for i in tl.static_range(M):
        m = tl.max(x, 0)
        a = tl.argmax(x, 0, tie_break_left=True)
        tl.store(out + i, tl.where(m > float("-inf"), chunk * CHUNK + a, -1))
        x = tl.where(tl.arange(0, CHUNK) == a, float("-inf"), x)


@triton.jit
def markov_topk_sample_kernel(U, cand, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                              N, V, R, NC, stride_ub, stride_uk,
                              BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Z: tl.constexpr):
    """One program per row runs the N sequential steps over its NC candidates per step."""
    b = tl.program_id(0)
    anc = tl.load(anchor + b)
    live = anc >= 0
    temp = tl.load(temperature + b).to(tl.float32)
    greedy = temp <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(temp, 1e-6))
    sd = tl.load(seed + b)
    st = tl.load(start + b)
    if live:
        prev = tl.maximum(anc, 0).to(tl.int64)
        cc = tl.arange(0, BLOCK_C)
        rr0 = tl.arange(0, BLOCK_R)
        for k in range(0, N):
            ci = tl.load(cand + (b.to(tl.int64) * N + k) * NC + cc, mask=cc < NC, other=-1)
            cv = ci >= 0
            col = tl.maximum(ci, 0).to(tl.int64)
            acc = tl.zeros([BLOCK_C], tl.float32)
            for r0 in range(0, R, BLOCK_R):
                rr = r0 + rr0
                rm = rr < R
                h = tl.load(w1 + prev * R + rr, mask=rm, other=0.0).to(tl.float32)
                w = tl.load(w2 + col[:, None] * R + rr[None, :], mask=cv[:, None] & rm[None, :],
                            other=0.0).to(tl.float32)
                acc += tl.sum(w * h[None, :], 1)
            u = tl.load(U + b.to(tl.int64) * stride_ub + k * stride_uk + col, mask=cv, other=0.0)
            z = u.to(tl.float32) + acc
            tl.store(z_out + (b.to(tl.int64) * N + k) * V + col, z, mask=cv)
            key = row_key(sd, st + k + 1, STREAM_DRAFT)
            score = tl.where(greedy, z, z * inv_t + gumbel(key, col))
            score = tl.where(cv, score, float("-inf"))
            best = tl.max(score, 0)
            x = tl.min(tl.where(score == best, col, 2147483647), 0)
            tl.store(tokens_out + b * N + k, x)
            prev = x
    else:
        for k in range(0, N):
            tl.store(tokens_out + b * N + k, -1)
        for v0 in range(0, N * V, BLOCK_Z):
            offs = v0 + tl.arange(0, BLOCK_Z)
            tl.store(z_out + b.to(tl.int64) * N * V + offs, 0.0, mask=offs < N * V)


def markov_sample_topk_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                              seed: Tensor, start: Tensor, chunk: int = 4096,
                              per_chunk: int = 4) -> tuple[Tensor, Tensor]:
    """Fast mode; same contract as ``markov_sample_topk_ref`` (two launches + one fill)."""
    B, N, V = U.shape
    Rk = w1.shape[1]
    dev = U.device
    if chunk != pow2(chunk):
        raise ValueError(f"markov_sample_topk: chunk must be a power of two, got {chunk}")
    tokens = torch.empty((B, N), dtype=torch.int64, device=dev)
    z = torch.full((B, N, V), float("-inf"), dtype=torch.float32, device=dev)
    if B == 0 or N == 0:
        return tokens, z
    if U.stride(-1) != 1:
        U = U.contiguous()
    n_chunks = triton.cdiv(V, chunk)
    nc = n_chunks * per_chunk
    cand = torch.empty((B, N, nc), dtype=torch.int32, device=dev)
    launcher(markov_candidates_kernel)[(B * N, n_chunks)](
        U, cand, V, N, U.stride(0), U.stride(1), M=per_chunk, CHUNK=chunk, num_warps=8)
    w1c, w2c = (w1.contiguous(), w2.contiguous()) if Rk else (U, U)
    launcher(markov_topk_sample_kernel)[(B,)](
        U, cand, anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(),
        start.contiguous(), z, tokens, N, V, Rk, nc, U.stride(0), U.stride(1),
        BLOCK_C=pow2(nc, 16), BLOCK_R=min(64, pow2(Rk, 16)), BLOCK_Z=1024, num_warps=8)
    return tokens, z
