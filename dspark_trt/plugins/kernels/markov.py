"""Triton kernels of ``dspark::markov_sample`` (exact, full vocabulary) and
``dspark::markov_sample_topk`` (fast, candidate-restricted proposal).

Exact mode. Step k reads W2 [V, r] once for *all* rows: the vocabulary is cut into BLOCK_V tiles
dealt round-robin to C programs; a program computes ``z = U_k + W1[prev] @ W2_tile^T`` for every
row, stores z, scores it (``z`` at T = 0, else ``z / T + Gumbel``) and keeps its best (score,
index) per row. The token of step k is the best of the C programs' (ties -> smallest index, like
``torch.argmax``): one ``atomic_max`` per program of the packed (score, index) (``_pack_best``) in
the one-launch schedule, a reduction of per-program partials in the per-step ones. A batch-1 greedy
row skips the Gumbel noise. Two tile bodies:

* ``gemv=False``: ``tl.dot`` over BLOCK_R slices of the rank (tensor cores; rows padded to 16).
* ``gemv=True`` (batch <= GEMV_MAX_B): whole-rank tiles, ``sum(W2_tile * h)`` on CUDA cores, few registers
  (many resident programs keep the loads in flight; ``pipeline=True`` also loads tile i+1 before
  reducing tile i); the first tile of a step is loaded before the program waits for the previous
  token, hiding that dependency.

``snake=True`` walks the tiles in reverse on odd steps, so a step starts on the tiles the previous
step touched last (still in L2: W2 is larger than L2, a same-order sweep always misses);
``l2_keep`` (gemv body) marks that last part of each sweep evict_last and the rest evict_first.

Schedules:

* ``one_launch=True``: a persistent grid (``resident_per_sm`` programs per SM, all resident at once)
  runs the N steps with a grid-wide barrier (atomic counter) between steps. A barrier is only safe
  when every program is resident, so on a GPU the grid is clamped to what the compiled kernel's
  registers, warps and shared memory let each SM hold (``resident_grid``).
* ``one_launch=False``, ``reduce="ticket"``: one launch of ``markov_step_kernel`` per step; the
  program that finishes a step last (an atomic ticket per row group, no grid barrier) reduces the
  partials and writes the token; the next launch reads ``prev`` from the token output.
* ``one_launch=False``, ``reduce="prologue"``: one launch of ``markov_sample_kernel`` per step; its
  programs reduce the previous step's partials themselves (no ticket, no zeroed workspace), and a
  final one-program-per-row-group launch writes the last token.
* ``rows_only=True``: ``markov_rows_kernel``, one program per row group (TensorRT AOT entry).

Launch parameters come from ``markov_config`` (defaults in ``MARKOV_DEFAULTS``).
Fast mode: see ``markov_sample_topk_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, STREAM_DRAFT, gumbel, launcher, max_resident_programs, num_sms, pow2, row_key

INT_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _reduce_partials(part_val, part_idx, rows, rmask, C, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Argmax over the C per-program partials of ``rows`` (part_* + row * C + c), BLOCK_C at a
    time; ties -> smallest index."""
    bv = tl.full([BLOCK_B], float("-inf"), tl.float32)
    bi = tl.full([BLOCK_B], INT_MAX, tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cc[None, :] < C)
        off = rows.to(tl.int64)[:, None] * C + cc[None, :]
        val = tl.load(part_val + off, mask=m, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(part_idx + off, mask=m, other=INT_MAX, cache_modifier=".cg")
        cm = tl.max(val, 1)
        ci = tl.min(tl.where(val == cm[:, None], idx, INT_MAX), 1)
        take = (cm > bv) | ((cm == bv) & (ci < bi))
        bi = tl.where(take, ci, bi)
        bv = tl.maximum(bv, cm)
    return bi


@triton.jit
def _pack_best(score, idx):
    """(fp32 score, int32 index >= 0) -> int64 > 0 ordered like the argmax: higher score, then
    smaller index (ties -> smallest index, like ``torch.argmax``); 0 is below every packed value."""
    bits = tl.where(score == 0, 0.0, score).to(tl.int32, bitcast=True).to(tl.int64)   # -0.0 ties +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + tl.full([], 1 << 31, tl.int64)   # [0, 2^32)
    low = tl.full([], 2147483647, tl.int64) - idx.to(tl.int64)                           # smaller index, larger
    return (ordered << 31) | low


@triton.jit
def _unpack_index(packed):
    """Index of a ``_pack_best`` value (int64)."""
    low = tl.full([], 2147483647, tl.int64)
    return low - (packed & low)


@triton.jit
def _tile_at(i, c, C, n_tiles, rev):
    """Vocabulary tile of program c's i-th iteration (reversed order when ``rev``)."""
    t = c + i * C
    return tl.where(rev, n_tiles - 1 - t, t)


@triton.jit
def _w2_tile(w2, tile, V, R, keep, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, L2_HINTS: tl.constexpr):
    """W2 rows of a vocabulary tile, whole rank: [BLOCK_V, BLOCK_R]; a tile past the end loads
    nothing. With L2_HINTS, ``keep`` tiles are loaded evict_last (the next step, walking the other
    way, starts on them) and the others evict_first."""
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    rr = tl.arange(0, BLOCK_R)
    ptrs = w2 + cols.to(tl.int64)[:, None] * R + rr[None, :]
    mask = (cols < V)[:, None] & (rr < R)[None, :]
    if L2_HINTS:
        if keep:
            w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        else:
            w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def _u_tile(U, rows, live, k, tile, V, stride_ub, stride_uk, BLOCK_V: tl.constexpr):
    """Base logits U_k of a vocabulary tile: [BLOCK_B, BLOCK_V] fp32 (0 for dead rows / past V)."""
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    m2 = live[:, None] & (cols < V)[None, :]
    return tl.load(U + rows.to(tl.int64)[:, None] * stride_ub + k * stride_uk + cols[None, :],
                   mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _tile_pair(w2, U, rows, live, k, tile, keep, V, R, stride_ub, stride_uk, BLOCK_V: tl.constexpr,
               BLOCK_R: tl.constexpr, L2_HINTS: tl.constexpr):
    """The W2 and U_k tiles of one vocabulary tile; neither depends on the previous token."""
    return (_w2_tile(w2, tile, V, R, keep, BLOCK_V, BLOCK_R, L2_HINTS),
            _u_tile(U, rows, live, k, tile, V, stride_ub, stride_uk, BLOCK_V))


@triton.jit
def _first_tile(w2, U, rows, live, k, c, C, n_tiles, rev, keep_from, V, R, stride_ub, stride_uk,
                BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, L2_HINTS: tl.constexpr):
    """Program c's first W2 and U_k tiles of step k."""
    tile = tl.where(c < n_tiles, _tile_at(0, c, C, n_tiles, rev), n_tiles)   # past the end: masked
    return _tile_pair(w2, U, rows, live, k, tile, c >= keep_from, V, R, stride_ub, stride_uk, BLOCK_V, BLOCK_R,
                      L2_HINTS)


@triton.jit
def _store_z_and_score(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, N, V,
                       BLOCK_V: tl.constexpr):
    """z = U_k tile ``u`` + acc: store it; return (cols, score) of the tile ([BLOCK_V] and
    [BLOCK_B, BLOCK_V]; -inf past V)."""
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    m2 = live[:, None] & cmask[None, :]
    z = u + acc                                                                    # bias first, like the reference
    tl.store(z_out + (rows.to(tl.int64) * N + k)[:, None] * V + cols[None, :],
             tl.where(m2, z, 0.0), mask=rmask[:, None] & cmask[None, :])
    if rows.shape[0] == 1:              # one row: a greedy row skips the Gumbel noise (a branch, not a select)
        if tl.max(greedy.to(tl.int32), 0) == 1:
            score = z
        else:
            score = z * inv_t[:, None] + gumbel(key[:, None], cols[None, :])
    else:
        score = tl.where(greedy[:, None], z, z * inv_t[:, None] + gumbel(key[:, None], cols[None, :]))
    return cols, tl.where(cmask[None, :], score, float("-inf"))


@triton.jit
def _score_tile(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, best, arg, N, V,
                BLOCK_V: tl.constexpr):
    """Store and score a tile, fold its argmax into (best, arg) [BLOCK_B]."""
    _, score = _store_z_and_score(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, N, V, BLOCK_V)
    tmax = tl.max(score, 1)
    targ = tile * BLOCK_V + tl.argmax(score, 1, tie_break_left=True)
    take = (tmax > best) | ((tmax == best) & (targ < arg))                         # tiles come in any order
    return tl.maximum(best, tmax), tl.where(take, targ, arg)


@triton.jit
def _step_dot(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c, C, n_tiles, rev,
              N, V, R, stride_ub, stride_uk, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """Step k over program c's tiles with ``tl.dot``: return the best (score, index) per row."""
    best = tl.full([BLOCK_B], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_B], INT_MAX, tl.int32)
    rr0 = tl.arange(0, BLOCK_R)
    for i in range(0, tl.cdiv(n_tiles - c, C)):
        tile = _tile_at(i, c, C, n_tiles, rev)
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        cmask = cols < V
        u = _u_tile(U, rows, live, k, tile, V, stride_ub, stride_uk, BLOCK_V)
        acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + rr0
            rm = rr < R
            h = tl.load(w1 + prev[:, None] * R + rr[None, :],
                        mask=live[:, None] & rm[None, :], other=0.0)                  # [BLOCK_B, BLOCK_R]
            w = tl.load(w2 + cols.to(tl.int64)[:, None] * R + rr[None, :],
                        mask=cmask[:, None] & rm[None, :], other=0.0)                 # [BLOCK_V, BLOCK_R]
            acc += tl.dot(h.to(w.dtype), tl.trans(w), input_precision="ieee")
        best, arg = _score_tile(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, best, arg,
                                N, V, BLOCK_V)
    return best, arg


@triton.jit
def _gemv_tile(w, h, BLOCK_B: tl.constexpr):
    """W2 tile [BLOCK_V, BLOCK_R] times h -> [BLOCK_B, BLOCK_V] fp32 on CUDA cores; h is
    [BLOCK_R] when BLOCK_B == 1 (keeps the tile in its load layout), else [BLOCK_B, BLOCK_R]."""
    if BLOCK_B == 1:
        return tl.sum(w.to(tl.float32) * h[None, :], 1)[None, :]
    else:
        return tl.sum(w.to(tl.float32)[None, :, :] * h[:, None, :], 2)


@triton.jit
def _w1_rows(w1, prev, live, R, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
    """h = W1[prev]: [BLOCK_R] fp32 when BLOCK_B == 1, else [BLOCK_B, BLOCK_R]; 0 for dead rows."""
    rr = tl.arange(0, BLOCK_R)
    if BLOCK_B == 1:
        p0 = tl.max(prev, 0)
        h = tl.load(w1 + p0 * R + rr, mask=rr < tl.where(tl.max(live.to(tl.int32), 0) > 0, R, 0),
                    other=0.0).to(tl.float32)
    else:
        h = tl.load(w1 + prev[:, None] * R + rr[None, :], mask=live[:, None] & (rr < R)[None, :],
                    other=0.0).to(tl.float32)
    return h


@triton.jit
def _score_lanes(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, best, arg, N, V,
                 BLOCK_V: tl.constexpr):
    """``_score_tile`` without the per-tile reduction: (best, arg) [BLOCK_B, BLOCK_V] keep the best
    score of each lane (column position in a tile) over the tiles seen; no cross-warp traffic."""
    cols, score = _store_z_and_score(acc, u, z_out, rows, rmask, live, greedy, inv_t, key, k, tile, N, V,
                                     BLOCK_V)
    take = (score > best) | ((score == best) & (cols[None, :] < arg))              # tiles come in any order
    return tl.maximum(best, score), tl.where(take, cols[None, :], arg)


@triton.jit
def _step_gemv(w_first, u_first, h, U, w2, z_out, rows, rmask, live, greedy, inv_t, key, k, c, C, n_tiles,
               rev, keep_from, N, V, R, stride_ub, stride_uk, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_R: tl.constexpr, L2_HINTS: tl.constexpr, PIPELINE: tl.constexpr):
    """Step k over program c's tiles on CUDA cores (BLOCK_R covers the rank): the best (score,
    index) per row, reduced across lanes once at the end. ``w_first`` and ``u_first``, the
    program's first W2 and U_k tiles, were loaded before the previous token (h = W1[prev]) was
    known. Without PIPELINE, latency is hidden by occupancy only (few registers per program); with
    it, the W2 and U tiles i+1 are loaded before tile i is reduced (two tiles in flight)."""
    best = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_B, BLOCK_V], INT_MAX, tl.int32)
    tile = tl.where(c < n_tiles, _tile_at(0, c, C, n_tiles, rev), n_tiles)   # past the end: masked
    w = w_first
    u = u_first
    for i in range(1, tl.cdiv(n_tiles - c, C)):
        nxt = _tile_at(i, c, C, n_tiles, rev)
        keep = c + i * C >= keep_from                        # by sweep position
        if PIPELINE:                                         # next tiles in flight while this one is reduced
            w_next, u_next = _tile_pair(w2, U, rows, live, k, nxt, keep, V, R, stride_ub, stride_uk, BLOCK_V,
                                        BLOCK_R, L2_HINTS)
        best, arg = _score_lanes(_gemv_tile(w, h, BLOCK_B), u, z_out, rows, rmask, live, greedy,
                                 inv_t, key, k, tile, best, arg, N, V, BLOCK_V)
        if not PIPELINE:
            w_next, u_next = _tile_pair(w2, U, rows, live, k, nxt, keep, V, R, stride_ub, stride_uk, BLOCK_V,
                                        BLOCK_R, L2_HINTS)
        w, u, tile = w_next, u_next, nxt
    best, arg = _score_lanes(_gemv_tile(w, h, BLOCK_B), u, z_out, rows, rmask, live, greedy,
                             inv_t, key, k, tile, best, arg, N, V, BLOCK_V)
    top = tl.max(best, 1)
    return top, tl.min(tl.where(best == top[:, None], arg, INT_MAX), 1)


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
def _slot_rows(B):
    """Row stride of the packed slots: B rounded up to 16 int64 (each step's slots on their own
    128-byte lines)."""
    return tl.cdiv(B, 16) * 16


@triton.jit
def _token_of_step(part_val, part_idx, slots, k, B, rows, rmask, C, BLOCK_B: tl.constexpr,
                   BLOCK_C: tl.constexpr, PACKED: tl.constexpr):
    """Token of step k per row, int64: read back from ``slots`` (PACKED) or reduced from the C
    partials."""
    if PACKED:
        packed = tl.load(slots + k * _slot_rows(B) + rows, mask=rmask, other=0, cache_modifier=".cg")
        return _unpack_index(packed)
    else:
        return _reduce_partials(part_val, part_idx, k * B + rows, rmask, C, BLOCK_B, BLOCK_C).to(tl.int64)


@triton.jit
def _grid_wait(counter, target):
    """Spin until ``target`` programs have arrived at the grid barrier."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def markov_sample_kernel(U, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                         part_val, part_idx, counter, slots,
                         B, N, V, R, C, K0, K1, stride_ub, stride_uk, KEEP_FROM,
                         BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, GRID_SYNC: tl.constexpr, WRITE_LAST: tl.constexpr,
                         GEMV: tl.constexpr, SNAKE: tl.constexpr, L2_HINTS: tl.constexpr,
                         PIPELINE: tl.constexpr, PACKED: tl.constexpr):
    """Grid (C, row groups); steps K0..K1-1; partials [N, B, C]. Step k > 0 starts by reducing
    step k-1's partials (after the grid barrier when GRID_SYNC). With PACKED (GRID_SYNC only) a
    program folds its best into ``slots`` [N, B rounded up to 16] (int64 zeros) with one
    ``atomic_max`` of the packed (score, index) instead, and step k > 0 reads the token back with
    one load."""
    c = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    anc, live, greedy, inv_t, sd, st = _row_params(anchor, temperature, seed, start, rows, rmask)
    n_tiles = tl.cdiv(V, BLOCK_V)
    total = C * tl.num_programs(1)
    for k in range(K0, K1):
        rev = (k % 2) * SNAKE == 1
        if GEMV:                                             # in flight while waiting for prev
            w0, u0 = _first_tile(w2, U, rows, live, k, c, C, n_tiles, rev, KEEP_FROM, V, R, stride_ub,
                                 stride_uk, BLOCK_V, BLOCK_R, L2_HINTS)
        if k == 0:
            prev = tl.maximum(anc, 0).to(tl.int64)
        else:
            if GRID_SYNC:
                _grid_wait(counter, total * k)
            prev = _token_of_step(part_val, part_idx, slots, k - 1, B, rows, rmask, C, BLOCK_B, BLOCK_C, PACKED)
            if c == 0:
                tl.store(tokens_out + rows * N + (k - 1), tl.where(live, prev, -1), mask=rmask)
        key = row_key(sd, st + k + 1, STREAM_DRAFT)                                   # [BLOCK_B]
        if GEMV:
            best, arg = _step_gemv(w0, u0, _w1_rows(w1, prev, live, R, BLOCK_B, BLOCK_R), U, w2, z_out, rows,
                                   rmask, live, greedy, inv_t, key, k, c, C, n_tiles, rev, KEEP_FROM, N, V, R,
                                   stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R, L2_HINTS, PIPELINE)
        else:
            best, arg = _step_dot(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c,
                                  C, n_tiles, rev, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
        if PACKED:
            tl.atomic_max(slots + k * _slot_rows(B) + rows, _pack_best(best, arg), mask=rmask, sem="relaxed")
        else:
            poff = (k * B + rows) * C + c
            tl.store(part_val + poff, best, mask=rmask)
            tl.store(part_idx + poff, arg, mask=rmask)
        tl.debug_barrier()                                   # partials visible to the whole program
        if GRID_SYNC:                                        # ... and, after the wait, to the grid
            tl.atomic_add(counter, 1, sem="release")
    if WRITE_LAST:
        if c == 0:
            if GRID_SYNC:
                _grid_wait(counter, total * N)
            last = _token_of_step(part_val, part_idx, slots, N - 1, B, rows, rmask, C, BLOCK_B, BLOCK_C, PACKED)
            tl.store(tokens_out + rows * N + (N - 1), tl.where(live, last, -1), mask=rmask)


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
    n_tiles = tl.cdiv(V, BLOCK_V)
    for k in range(0, N):
        key = row_key(sd, st + k + 1, STREAM_DRAFT)
        best, arg = _step_dot(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, 0, 1,
                              n_tiles, False, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
        tl.store(tokens_out + rows * N + k, tl.where(live, arg, -1).to(tl.int64), mask=rmask)
        prev = arg.to(tl.int64)


@triton.jit
def markov_step_kernel(U, anchor, w1, w2, temperature, seed, start, z_out, tokens_out,
                       part_val, part_idx, ticket, B, N, V, R, C, k, stride_ub, stride_uk, KEEP_FROM,
                       BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, GEMV: tl.constexpr, SNAKE: tl.constexpr,
                       L2_HINTS: tl.constexpr, PIPELINE: tl.constexpr):
    """Grid (C, row groups), step k; partials [B, C]; ticket [N, row groups] int32 zeros."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    rows = g * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    anc, live, greedy, inv_t, sd, st = _row_params(anchor, temperature, seed, start, rows, rmask)
    n_tiles = tl.cdiv(V, BLOCK_V)
    rev = (k % 2) * SNAKE == 1
    if GEMV:
        w0, u0 = _first_tile(w2, U, rows, live, k, c, C, n_tiles, rev, KEEP_FROM, V, R, stride_ub, stride_uk,
                             BLOCK_V, BLOCK_R, L2_HINTS)
    if k == 0:
        prev = tl.maximum(anc, 0).to(tl.int64)
    else:                                                    # written by the previous launch
        prev = tl.maximum(tl.load(tokens_out + rows * N + (k - 1), mask=rmask, other=0), 0)
    key = row_key(sd, st + k + 1, STREAM_DRAFT)
    if GEMV:
        best, arg = _step_gemv(w0, u0, _w1_rows(w1, prev, live, R, BLOCK_B, BLOCK_R), U, w2, z_out, rows,
                               rmask, live, greedy, inv_t, key, k, c, C, n_tiles, rev, KEEP_FROM, N, V, R,
                               stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R, L2_HINTS, PIPELINE)
    else:
        best, arg = _step_dot(U, w1, w2, z_out, rows, rmask, live, greedy, inv_t, key, prev, k, c,
                              C, n_tiles, rev, N, V, R, stride_ub, stride_uk, BLOCK_B, BLOCK_V, BLOCK_R)
    tl.store(part_val + rows * C + c, best, mask=rmask)
    tl.store(part_idx + rows * C + c, arg, mask=rmask)
    tl.debug_barrier()                                       # every thread's partial is stored
    if tl.atomic_add(ticket + k * tl.num_programs(1) + g, 1, sem="acq_rel") == C - 1:
        bi = _reduce_partials(part_val, part_idx, rows, rmask, C, BLOCK_B, BLOCK_C)   # last program of the group
        tl.store(tokens_out + rows * N + k, tl.where(live, bi, -1).to(tl.int64), mask=rmask)


# Defaults of the exact sampler's launch (benchmarks/tune_plugins.py measures alternatives).
# block_v / block_r: W2 tile of the dot body (the gemv body takes the whole rank and, unless given,
# block_v = GEMV_TILE_ELEMS // rank: 16 KB of bf16 per program, ~64 registers per thread at 8 warps);
# programs_per_sm: target programs per SM of the per-step schedules; resident_per_sm: programs per SM
# of the one-launch schedule (clamped to what fits);
# packed (one_launch): a program folds its best (score, index) into the step's slot with one
# atomic_max and the next step reads it back with one load; False: per-program partials that every
# program reduces after the barrier;
# reduce: "ticket" or "prologue" (per-step schedules); gemv: CUDA-core body for batches <= GEMV_MAX_B;
# pipeline (gemv): load the next W2 and U tiles before reducing the current one;
# l2_keep (gemv): fraction of each step's sweep loaded evict_last, the rest evict_first (with snake,
# the next step starts on the kept tiles; W2 of Qwen3-8B is 78 MB, the H200's L2 60 MB).
MARKOV_DEFAULTS = dict(one_launch=False, block_v=128, block_r=64, programs_per_sm=4, resident_per_sm=1,
                       reduce="ticket", gemv=False, pipeline=False, snake=False, l2_keep=0.0, num_warps=None,
                       num_stages=3, packed=True)
# Overrides of MARKOV_DEFAULTS for batches up to GEMV_MAX_B; empty = the same defaults for every batch.
MARKOV_SMALL_B: dict = dict(reduce="prologue", snake=True)   # H200, B=1 V=151936 r=256: 200 vs 219 us
# The batch-1 schedule, used unless the caller picks one_launch or gemv itself. H200, B=1 N=7, cold
# L2 (benchmarks/markov_l2.py, markov-l2-NVIDIA_H200-1471c02.json): V=151936 r=256 138 us greedy
# (83% of 4.8 TB/s), 146 us sampled (T=0.8); 151 us with per-program partials instead of the packed
# atomic_max (packed=False), 144 us without pipeline, 198 us of MARKOV_SMALL_B's per-step launches;
# 169 us of 7 torch.mv (cuBLAS GEMV), 186 us of 7 plain reads of W2 (torch.sum). Pipelining only
# pays while two tiles in flight leave room for enough programs: V=129280 r=512 (16 KB tiles) 229 us
# without, 230 us with (3 programs per SM instead of 4). Batches 2..4 keep MARKOV_SMALL_B (B=4 in one
# launch: 741 vs 348 us, markov-l2-NVIDIA_H200-f4e9738.json).
MARKOV_B1: dict = dict(one_launch=True, gemv=True, block_v=16, num_warps=4, resident_per_sm=6, snake=True,
                       pipeline=True)
# Batches ONE_LAUNCH_B[0]..ONE_LAUNCH_B[1] run the tensor-core body in one launch (same file,
# V=151936 r=256: B=32 480 vs 548 us per step, B=64 644 vs 856 us; B=16 408 vs 364 and B=8 398 vs
# 355 us stay per step; larger batches are not measured).
ONE_LAUNCH_B = (32, 64)
SLOTS_OFFSET = 16         # int64s between the barrier counter and the packed slots: another 128-byte line
PIPELINE_MAX_TILE = 4096   # W2 elements per gemv tile up to which MARKOV_B1 pipelines (8 KB of bf16)
GEMV_MAX_B = 4
GEMV_TILE_ELEMS = 8192


EXPORT_ROWS_HINT = 16      # exported engines: row tiles of 16 (batch-independent), per-step schedule


def markov_config(B: int, V: int, R: int, device: torch.device, **overrides) -> dict:
    """Launch config of the exact sampler from shapes; ``overrides`` (not None) replace defaults.
    Adds block_b (rows per program), groups, C (programs per row group) and num_warps."""
    given = {k: v for k, v in overrides.items() if v is not None}
    small = MARKOV_SMALL_B if B <= GEMV_MAX_B else {}
    b1 = MARKOV_B1 if B == 1 and not {"one_launch", "gemv"} & set(given) else {}
    large = dict(one_launch=True) if ONE_LAUNCH_B[0] <= B <= ONE_LAUNCH_B[1] else {}
    cfg = {**MARKOV_DEFAULTS, **small, **large, **b1, **given}
    one_launch = cfg["one_launch"]
    if cfg["reduce"] not in ("ticket", "prologue"):
        raise ValueError(f"markov_sample: reduce must be 'ticket' or 'prologue', got {cfg['reduce']!r}")
    gemv = bool(cfg["gemv"]) and B <= GEMV_MAX_B
    cfg["gemv"] = gemv
    if gemv:
        cfg["block_b"] = pow2(B)
        cfg["block_r"] = pow2(R, 16)
        cfg["block_v"] = (given.get("block_v") or b1.get("block_v") or small.get("block_v")   # not the dot tile's
                          or max(16, GEMV_TILE_ELEMS // cfg["block_r"]))
        if b1 and "pipeline" not in given and cfg["block_v"] * cfg["block_r"] > PIPELINE_MAX_TILE:
            cfg["pipeline"] = False
    else:
        cfg["block_b"] = min(pow2(B, 16), 64)
        cfg["block_r"] = min(cfg["block_r"], pow2(R, 16))
    cfg["groups"] = triton.cdiv(B, cfg["block_b"])
    n_tiles = triton.cdiv(V, cfg["block_v"])
    if cfg.get("num_programs"):
        C = cfg["num_programs"]
    elif one_launch:                            # all programs resident: resident_per_sm per SM
        C = max(1, cfg["resident_per_sm"] * num_sms(device) // cfg["groups"])
    else:                                       # ~programs_per_sm per SM (one wave), whole tiles each
        per_program = triton.cdiv(n_tiles, cfg["programs_per_sm"] * num_sms(device))
        C = triton.cdiv(n_tiles, per_program)
    cfg["C"] = C
    cfg["num_warps"] = cfg["num_warps"] or (8 if gemv or cfg["block_b"] > 16 else 4)
    return cfg


_FIT_CACHE: dict = {}


def _int_specialisation(args) -> tuple:
    """How Triton specialises the integer arguments of a launch (equal to 1, multiple of 16): each
    specialisation is its own compiled kernel, with its own register count."""
    return tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int) and not isinstance(a, bool))


def _resident_c(head, C, groups, dev, N, strides, meta) -> int:
    """C cut to what the compiled one-launch kernel lets every SM hold; compiled again for the new C
    (a C that specialises differently may change the registers). The fit is cached per compiled
    variant: dtypes, constexprs and the specialisation of every integer argument (N = 1 differs)."""
    for _ in range(3):
        key = (dev.index, _int_specialisation((*head, C, 0, N, *strides)), tuple(sorted(meta.items())),
               tuple(str(t.dtype) for t in head if isinstance(t, torch.Tensor)))
        if key not in _FIT_CACHE:
            compiled = markov_sample_kernel.warmup(*head, C, 0, N, *strides, grid=(C, groups), **meta)
            _FIT_CACHE[key] = max_resident_programs(compiled, dev)
        cut = resident_grid(C, groups, _FIT_CACHE[key], num_sms(dev))
        if cut == C:
            return C
        C = cut
    return C


def resident_grid(C: int, groups: int, fit_per_sm: int, sms: int) -> int:
    """Programs per row group of a one-launch grid, cut so that all ``C * groups`` are resident at
    once (a grid barrier over a program that cannot be scheduled never returns)."""
    if fit_per_sm * sms < groups:
        raise RuntimeError(f"markov_sample one_launch: {groups} row groups cannot all be resident "
                           f"({fit_per_sm} programs per SM fit); use the per-step schedule")
    return min(C, fit_per_sm * sms // groups)


def markov_sample_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                         seed: Tensor, start: Tensor, one_launch: bool | None = None, rows_only: bool = False,
                         num_programs: int | None = None, block_v: int | None = None,
                         block_r: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, reduce: str | None = None, gemv: bool | None = None,
                         snake: bool | None = None, programs_per_sm: int | None = None,
                         l2_keep: float | None = None, resident_per_sm: int | None = None,
                         pipeline: bool | None = None, packed: bool | None = None) -> tuple[Tensor, Tensor]:
    """Exact full-vocabulary Markov sampler; same contract as ``markov_sample_ref``.

    The grid is (C, row groups): C programs split the vocabulary, axis 1 splits the rows. Schedules
    and options: see the module doc; unset options come from ``markov_config``. ``rows_only`` runs
    ``markov_rows_kernel`` (one program per row group, the schedule of the TensorRT AOT plugin)."""
    B, N, V = U.shape
    Rk = w1.shape[1]
    dev = U.device
    tokens = torch.empty((B, N), dtype=torch.int64, device=dev)
    z = torch.empty((B, N, V), dtype=torch.float32, device=dev)
    if B == 0 or N == 0:
        return tokens, z
    if U.stride(-1) != 1:
        U = U.contiguous()
    static = isinstance(B, int)
    if not static:  # traced with a dynamic batch (torch.export): no launch choice may depend on it
        gemv = False
    if not static or rows_only or torch.compiler.is_compiling():
        one_launch = False      # traced: the grid cannot be checked against residency -> per step
    cfg = markov_config(B if static else EXPORT_ROWS_HINT, V, Rk, dev, one_launch=one_launch,
                        num_programs=num_programs, block_v=block_v, block_r=block_r, num_warps=num_warps,
                        num_stages=num_stages, reduce=reduce, gemv=False if rows_only else gemv,
                        snake=snake, programs_per_sm=programs_per_sm, l2_keep=l2_keep,
                        resident_per_sm=resident_per_sm, pipeline=pipeline, packed=packed)
    if not static:
        cfg["groups"] = triton.cdiv(B, cfg["block_b"])
    block_b, groups, C, one_launch = cfg["block_b"], cfg["groups"], cfg["C"], cfg["one_launch"]
    w1c, w2c = (w1.contiguous(), w2.contiguous()) if Rk else (U, U)   # rank 0 (DFlash): never read
    rowargs = (anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(), start.contiguous())
    tiles = dict(BLOCK_B=block_b, BLOCK_V=cfg["block_v"], BLOCK_R=cfg["block_r"], num_warps=cfg["num_warps"],
                 num_stages=cfg["num_stages"])
    if rows_only:
        launcher(markov_rows_kernel)[(groups,)](U, *rowargs, z, tokens, B, N, V, Rk, U.stride(0), U.stride(1),
                                                **tiles)
        return tokens, z
    hints = cfg["gemv"] and cfg["l2_keep"] > 0
    flags = dict(GEMV=cfg["gemv"], SNAKE=int(bool(cfg["snake"])), L2_HINTS=hints,
                 PIPELINE=bool(cfg["gemv"] and cfg["pipeline"]))
    n_tiles = triton.cdiv(V, cfg["block_v"])
    keep_from = n_tiles - int(cfg["l2_keep"] * n_tiles) if hints else n_tiles   # sweep positions kept in L2
    block_c = max(16, min(pow2(C), 4096 // block_b))             # partials reduced per iteration
    if not one_launch and cfg["reduce"] == "ticket":
        part_val = torch.empty((B, C), dtype=torch.float32, device=dev)
        part_idx = torch.empty((B, C), dtype=torch.int32, device=dev)
        ticket = torch.zeros((N, groups), dtype=torch.int32, device=dev)
        step = launcher(markov_step_kernel)
        for k in range(N):
            step[(C, groups)](U, *rowargs, z, tokens, part_val, part_idx, ticket, B, N, V, Rk, C, k,
                              U.stride(0), U.stride(1), keep_from, BLOCK_C=block_c, **tiles, **flags)
        return tokens, z
    if INTERPRET and one_launch:                # the interpreter runs programs one after another
        C, one_launch = 1, groups == 1
    packed = one_launch and bool(cfg["packed"])
    if packed:                                  # [counter, slots [N, B16]]: one zeroed buffer, no partials
        ws = torch.zeros(SLOTS_OFFSET + N * triton.cdiv(B, 16) * 16, dtype=torch.int64, device=dev)
        counter, slots = ws[:1], ws[SLOTS_OFFSET:]
        part_val = part_idx = slots             # unused
    else:
        part_val = torch.empty((N, B, C), dtype=torch.float32, device=dev)
        part_idx = torch.empty((N, B, C), dtype=torch.int32, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev) if one_launch else part_idx   # unused per step
        slots = part_idx                        # unused
    head = (U, *rowargs, z, tokens, part_val, part_idx, counter, slots, B, N, V, Rk)   # then C and the step range
    kernel = launcher(markov_sample_kernel)
    meta = dict(BLOCK_C=block_c, PACKED=packed, **tiles, **flags)
    strides = (U.stride(0), U.stride(1), keep_from)
    if one_launch:
        meta1 = dict(GRID_SYNC=True, WRITE_LAST=True, **meta)
        if dev.type == "cuda":                  # never a grid that cannot all be resident
            C = _resident_c(head, C, groups, dev, N, strides, meta1)
        kernel[(C, groups)](*head, C, 0, N, *strides, **meta1)
        return tokens, z
    for k in range(N):                          # reduce="prologue"
        kernel[(C, groups)](*head, C, k, k + 1, *strides, GRID_SYNC=False, WRITE_LAST=False, **meta)
    kernel[(1, groups)](*head, C, N, N, *strides, GRID_SYNC=False, WRITE_LAST=True, **meta)
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
