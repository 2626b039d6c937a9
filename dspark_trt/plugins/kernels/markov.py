"""Triton kernels of ``dspark::markov_sample`` (exact, full vocabulary) and
``dspark::markov_sample_topk`` (fast, candidate-restricted proposal).

Exact mode. Step k reads W2 [V, r] once for *all* rows: the vocabulary is split into BLOCK_V tiles
dealt round-robin to C programs; a program computes ``z = U_k + W1[prev] @ W2_tile^T`` for every
row (``tl.dot``, fp32 accumulation), stores z, scores it (``z`` at T = 0, else ``z / T + Gumbel``)
and keeps its best (score, index) per row. The token of step k is the reduction of the C partials
(ties -> smallest index, like ``torch.argmax``). Two launch schedules share one kernel:

* ``one_launch=True``: a persistent grid (C <= number of SMs, all programs resident) runs the N
  steps with a grid-wide barrier (atomic counter) between steps. On GPU only C <= SM count is safe.
* ``one_launch=False`` (default): one launch per step of ``markov_step_kernel`` with many programs
  (about four per SM, each one or two tiles), so enough W2 loads are in flight to stream it at
  HBM speed. The program that finishes a step last (an atomic ticket per row group, no grid
  barrier, so any grid size is safe) reduces the step's partials and writes the token; the next
  step's programs read ``prev`` from the token output.

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


@triton.jit
def markov_step_kernel(U, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                       part_val, part_idx, ticket, B, N, V, R, C, k, stride_ub, stride_uk,
                       BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """Grid (C, row groups), step k; partials [B, C]; ticket [N, row groups] int32 zeros."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    rows = g * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    anc, live, greedy, inv_t, sd, st = _row_params(anchor, temperature, seed, start, rows, rmask)
    if k == 0:
        prev = tl.maximum(anc, 0).to(tl.int64)
    else:                                                    # written by the previous launch
        prev = tl.maximum(tl.load(tokens_out + rows * N + (k - 1), mask=rmask, other=0), 0)
    key = row_key(sd, st + k + 1, STREAM_DRAFT)
    best, arg = _markov_step(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c,
                             C, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
    tl.store(part_val + rows * C + c, best, mask=rmask)
    tl.store(part_idx + rows * C + c, arg, mask=rmask)
    tl.debug_barrier()                                       # every thread's partial is stored
    if tl.atomic_add(ticket + k * tl.num_programs(1) + g, 1, sem="acq_rel") == C - 1:
        bv = tl.full([BLOCK_B], float("-inf"), tl.float32)  # last program of the group: reduce
        bi = tl.full([BLOCK_B], 2147483647, tl.int32)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (cc[None, :] < C)
            off = rows[:, None] * C + cc[None, :]
            val = tl.load(part_val + off, mask=m, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(part_idx + off, mask=m, other=2147483647, cache_modifier=".cg")
            cm = tl.max(val, 1)
            ci = tl.min(tl.where(val == cm[:, None], idx, 2147483647), 1)
            take = (cm > bv) | ((cm == bv) & (ci < bi))        # ties -> smallest index
            bi = tl.where(take, ci, bi)
            bv = tl.maximum(bv, cm)
        tl.store(tokens_out + rows * N + k, tl.where(live, bi, -1).to(tl.int64), mask=rmask)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def default_num_programs(device: torch.device) -> int:
    """Programs per row group of the one-launch schedule: one per SM (all must be resident)."""
    return num_sms(device)


def default_step_programs(device: torch.device, n_tiles: int) -> int:
    """Programs per row group and step of the per-step schedule: ~4 per SM, whole tiles each."""
    per_program = max(1, n_tiles // (4 * num_sms(device)))
    return triton.cdiv(n_tiles, per_program)


def markov_sample_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                         seed: Tensor, start: Tensor, one_launch: bool = True, rows_only: bool = False,
                         num_programs: int | None = None, block_v: int = 128,
                         block_r: int = 64, num_warps: int | None = None, num_stages: int = 3) -> tuple[Tensor, Tensor]:
    """Exact full-vocabulary Markov sampler; same contract as ``markov_sample_ref``.

    The grid is (C, ceil(B / 64)): C programs split the vocabulary, axis 1 splits the rows.
    ``num_programs`` (C) defaults to ~4 programs per SM per step (``one_launch=False``) or to the
    SM count divided by the number of row groups (``one_launch``: the whole grid must be resident
    at once, or the grid barrier would dead-lock). ``rows_only`` runs ``markov_rows_kernel`` instead (one program per row group,
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
    if isinstance(B, int):
        block_b = min(pow2(B, 16), 64)
    else:   # traced with a dynamic batch (torch.export): no launch choice may depend on it
        block_b, one_launch = 16, False
    groups = triton.cdiv(B, block_b)
    w1c, w2c = (w1.contiguous(), w2.contiguous()) if Rk else (U, U)   # rank 0 (DFlash): never read
    block_r = min(block_r, pow2(Rk, 16))
    if rows_only:
        launcher(markov_rows_kernel)[(groups,)](
            U, anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(),
            start.contiguous(), z, tokens, B, N, V, Rk, U.stride(0), U.stride(1), BLOCK_B=block_b,
            BLOCK_V=block_v, BLOCK_R=block_r, num_warps=num_warps or 4,
            num_stages=num_stages)
        return tokens, z
    rowargs = (anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(), start.contiguous())
    warps = num_warps or (4 if block_b <= 16 else 8)
    if not one_launch:
        C = num_programs or default_step_programs(dev, triton.cdiv(V, block_v))
        part_val = torch.empty((B, C), dtype=torch.float32, device=dev)
        part_idx = torch.empty((B, C), dtype=torch.int32, device=dev)
        ticket = torch.zeros((N, groups), dtype=torch.int32, device=dev)
        step = launcher(markov_step_kernel)
        for k in range(N):
            step[(C, groups)](U, *rowargs, z, tokens, part_val, part_idx, ticket, B, N, V, Rk, C, k,
                              U.stride(0), U.stride(1), BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=block_r,
                              BLOCK_C=128, num_warps=warps, num_stages=num_stages)
        return tokens, z
    C = max(1, (num_programs or default_num_programs(dev)) // groups)
    if INTERPRET:                               # the interpreter runs programs one after another
        C, one_launch = 1, groups == 1
    part_val = torch.empty((N, B, C), dtype=torch.float32, device=dev)
    part_idx = torch.empty((N, B, C), dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    common = dict(BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_C=pow2(C), num_warps=warps,
                  num_stages=num_stages)
    args = (U, *rowargs, z, tokens, part_val, part_idx, counter, B, N, V, Rk, C)
    kernel = launcher(markov_sample_kernel)
    if one_launch:
        kernel[(C, groups)](*args, 0, N, U.stride(0), U.stride(1), GRID_SYNC=True, WRITE_LAST=True, **common)
    else:                                       # interpreter with several row groups
        for k in range(N):
            kernel[(C, groups)](*args, k, k + 1, U.stride(0), U.stride(1), GRID_SYNC=False,
                                WRITE_LAST=False, **common)
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
def markov_topk_bias_kernel(cand, anchor, w1, w2, bias_out, N, R, NC,
                            BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (B * N, cdiv(NC, BLOCK_I), cdiv(NC, BLOCK_J)): every bias the walk can need, before it
    starts. For step k > 0 the previous token is one of the step k-1 candidates j, so
    ``bias[b, k, j, i] = W2[cand_k[i]] . W1[cand_{k-1}[j]]``; step 0 uses the anchor (j = 0 only).
    bias_out [B, N, NC (j), NC (i)] fp32."""
    bk = tl.program_id(0)
    k = bk % N
    ii = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    ci = tl.load(cand + bk.to(tl.int64) * NC + ii, mask=ii < NC, other=-1)
    if k == 0:
        cj = tl.where(jj == 0, tl.maximum(tl.load(anchor + bk // N), 0), -1).to(tl.int64)
    else:
        cj = tl.load(cand + (bk - 1).to(tl.int64) * NC + jj, mask=jj < NC, other=-1).to(tl.int64)
    vi, vj = ci >= 0, cj >= 0
    ci, cj = tl.maximum(ci, 0).to(tl.int64), tl.maximum(cj, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rm = rr < R
        a = tl.load(w2 + ci[:, None] * R + rr[None, :], mask=vi[:, None] & rm[None, :], other=0.0)
        h = tl.load(w1 + cj[:, None] * R + rr[None, :], mask=vj[:, None] & rm[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(h.to(a.dtype)), input_precision="ieee")             # [BLOCK_I, BLOCK_J]
    off = (bk.to(tl.int64) * NC + jj[None, :]) * NC + ii[:, None]
    tl.store(bias_out + off, acc, mask=(ii < NC)[:, None] & (jj < NC)[None, :])


@triton.jit
def markov_topk_walk_kernel(U, cand, bias, anchor, temperature, seed, start, z_out, tokens_out,
                            N, V, NC, stride_ub, stride_uk, BLOCK_C: tl.constexpr, BLOCK_Z: tl.constexpr):
    """Grid (B,): the N sequential steps of one row, now only lookups: z_k = U_k[cand_k] +
    bias[k, j_prev], sample, remember the sampled candidate's slot j_prev."""
    b = tl.program_id(0)
    anc = tl.load(anchor + b)
    temp = tl.load(temperature + b).to(tl.float32)
    greedy = temp <= 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(temp, 1e-6))
    sd = tl.load(seed + b)
    st = tl.load(start + b)
    if anc >= 0:
        cc = tl.arange(0, BLOCK_C)
        j = tl.full([], 0, tl.int32)                         # slot of the previous token (step 0: anchor)
        for k in range(0, N):
            ci = tl.load(cand + (b.to(tl.int64) * N + k) * NC + cc, mask=cc < NC, other=-1)
            cv = ci >= 0
            col = tl.maximum(ci, 0).to(tl.int64)
            u = tl.load(U + b.to(tl.int64) * stride_ub + k * stride_uk + col, mask=cv, other=0.0)
            bs = tl.load(bias + ((b.to(tl.int64) * N + k) * NC + j) * NC + cc, mask=cv, other=0.0)
            z = u.to(tl.float32) + bs
            tl.store(z_out + (b.to(tl.int64) * N + k) * V + col, z, mask=cv)
            key = row_key(sd, st + k + 1, STREAM_DRAFT)
            score = tl.where(greedy, z, z * inv_t + gumbel(key, col))
            score = tl.where(cv, score, float("-inf"))
            hit = score == tl.max(score, 0)
            x = tl.min(tl.where(hit, col, 2147483647), 0)
            tl.store(tokens_out + b * N + k, x)
            j = tl.minimum(tl.min(tl.where(hit & (col == x), cc, BLOCK_C), 0), NC - 1)
    else:
        for k in range(0, N):
            tl.store(tokens_out + b * N + k, -1)
        for v0 in range(0, N * V, BLOCK_Z):
            offs = v0 + tl.arange(0, BLOCK_Z)
            tl.store(z_out + b.to(tl.int64) * N * V + offs, 0.0, mask=offs < N * V)


def markov_sample_topk_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                              seed: Tensor, start: Tensor, chunk: int = 4096,
                              per_chunk: int = 4) -> tuple[Tensor, Tensor]:
    """Fast mode; same contract as ``markov_sample_topk_ref``. Everything that does not depend on
    the sampled tokens runs in parallel before the walk: the candidates of every (row, step)
    (``markov_candidates_kernel``) and every candidate-to-candidate bias (``markov_topk_bias_kernel``,
    NC x NC x r per step on tensor cores); the sequential ``markov_topk_walk_kernel`` only gathers.
    Launches: fill of z with -inf, candidates, biases, walk."""
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
    bias = torch.zeros((B, N, nc, nc), dtype=torch.float32, device=dev)
    if Rk:
        blk = min(64, pow2(nc, 16))
        launcher(markov_topk_bias_kernel)[(B * N, triton.cdiv(nc, blk), triton.cdiv(nc, blk))](
            cand, anchor.contiguous(), w1.contiguous(), w2.contiguous(), bias, N, Rk, nc,
            BLOCK_I=blk, BLOCK_J=blk, BLOCK_R=min(64, pow2(Rk, 16)), num_warps=4, num_stages=3)
    launcher(markov_topk_walk_kernel)[(B,)](
        U, cand, bias, anchor.contiguous(), temperature.contiguous(), seed.contiguous(),
        start.contiguous(), z, tokens, N, V, nc, U.stride(0), U.stride(1),
        BLOCK_C=pow2(nc, 16), BLOCK_Z=1024, num_warps=4)
    return tokens, z
