"""Triton kernels of ``dspark::markov_sample``, the exact full-vocabulary Markov sampler (their
launcher and launch configuration: ``markov_launch.py``; the fast top-k proposal: ``markov_topk.py``).

Step k reads W2 [V, r] once for *all* rows: the vocabulary is cut into BLOCK_V tiles
dealt round-robin to C programs; a program computes ``z = U_k + W1[prev] @ W2_tile^T`` for every
row, stores z, scores it (``z`` at T = 0, else ``z / T + Gumbel``) and keeps its best (score,
index) per row. The token of step k is the best of the C programs' (ties -> smallest index, like
``torch.argmax``): one ``atomic_max`` per program of the packed (score, index) (``_pack_best``) in
the one-launch schedule, a reduction of per-program partials in the per-step ones. A row group
whose rows are all greedy skips the Gumbel noise (a branch per tile: the counter hash and two
logarithms per logit are most of a tile's arithmetic at 64 rows). Two tile bodies:

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

Launch parameters come from ``markov_launch.markov_config`` (defaults in ``MARKOV_DEFAULTS``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import STREAM_DRAFT, gumbel, row_key

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
    elif tl.min(greedy.to(tl.int32), 0) == 1:   # every row greedy (rows past B too): no noise to draw
        score = z
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
