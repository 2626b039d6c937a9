"""Triton kernels of ``dspark::rejection_sample``.

Split schedule (``rejection_sample_triton``, the CUDA op): three launches, no host round trip,
workspaces sized from shapes only, so it replays in a CUDA graph and a batch-1 verify spreads over
the whole GPU.

1. ``rejection_stats_kernel``, grid (B * (2N+1), S): every target row ``L_0..L_N`` and draft row
   ``z_0..z_{N-1}`` is cut into S vocabulary chunks; each program writes its chunk's softmax
   statistics of ``x / T`` (max, sum of exponentials, first argmax) to a workspace. All rows are
   read once, in parallel, whatever the acceptance (greedy rows skip the draft rows).
2. ``rejection_residual_kernel``, grid (B, S2): every program merges the statistics, replays the
   acceptance test of each draft (greedy: ``x_j == argmax L_j``; sampled: ``u_j · q_j(x_j) <
   p_j(x_j)``) and so knows ``a`` (accepted drafts); program 0 writes ``accepted`` and the greedy
   next token. For sampled rows each program then scores its chunk of row ``a``: the residual
   ``max(p - q, 0)``, its mass, and the Gumbel argmax of ``log(residual)`` and of ``log(p)`` (the
   fallback when the mass is 0), written as partials.
3. ``rejection_finish_kernel``, grid (B,): merges those partials into the sampled next token.

Row schedule (``rejection_sample_kernel``, the TensorRT AOT entry, which has no workspace): one
program per row does the same work sequentially, stopping at the first rejection.

Both schedules tolerate rows masked to ``-inf`` (top-p): a chunk without a finite entry has
max ``-inf`` and sum 0. Ties go to the smallest index, like ``torch.argmax``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import STREAM_ACCEPT, STREAM_RESIDUAL, gumbel, launcher, num_sms, pow2, row_key, uniform

INT_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _finite_or_zero(m):
    """The running max to subtract: 0 while nothing finite was seen (exp(-inf - 0) = 0, no NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _chunk_argmax(ptr, lo, hi, BLOCK_V: tl.constexpr):
    """max and first argmax of x over entries [lo, hi) of one row (a greedy row: T = 1)."""
    m = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int32) + lo
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        cmax = tl.max(x, 0)
        arg = tl.where(cmax > m, v0 + tl.argmax(x, 0, tie_break_left=True), arg)
        m = tl.maximum(m, cmax)
    return m, arg


@triton.jit
def _chunk_softmax(ptr, lo, hi, t, BLOCK_V: tl.constexpr):
    """max m and sum of exp(x / t - m) over entries [lo, hi) of one row."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        xs = tl.load(ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(xs, 0))
        ref = _finite_or_zero(m_new)
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(xs - ref), 0)
        m = m_new
    return m, s


@triton.jit
def _chunk_stats(ptr, lo, hi, t, greedy, BLOCK_V: tl.constexpr):
    """(max, sum of exponentials, first argmax) of x / T over [lo, hi): a greedy row (T = 1) needs
    only the argmax (sum left 0), a sampled row only the softmax statistics (argmax left ``lo``)."""
    if greedy:
        m, arg = _chunk_argmax(ptr, lo, hi, BLOCK_V)
        s = tl.zeros([], tl.float32)
    else:
        m, s = _chunk_softmax(ptr, lo, hi, t, BLOCK_V)
        arg = tl.zeros([], tl.int32) + lo
    return m, s, arg


@triton.jit
def _residual_chunk(lrow, qrow, lo, hi, qhi, t, mp, sp, mq, sq, key, BLOCK_V: tl.constexpr):
    """Over entries [lo, hi) of row a: residual mass, and the Gumbel argmax (value, index) of
    log(max(p - q, 0)) and of log(p). q is read below ``qhi`` only (``lo`` at the bonus row: q = 0)."""
    mass = tl.zeros([], tl.float32)
    best_r = tl.full([], float("-inf"), tl.float32)
    arg_r = tl.zeros([], tl.int32) + lo
    best_p = tl.full([], float("-inf"), tl.float32)
    arg_p = tl.zeros([], tl.int32) + lo
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cm = cols < hi
        p = tl.exp(tl.load(lrow + cols, mask=cm, other=float("-inf")).to(tl.float32) / t - mp) / sp
        qm = cols < qhi
        q = tl.load(qrow + cols, mask=qm, other=0.0).to(tl.float32)
        q = tl.where(qm, tl.exp(q / t - mq) / sq, 0.0)
        r = tl.maximum(p - q, 0.0)
        mass += tl.sum(tl.where(cm, r, 0.0), 0)
        g = gumbel(key, cols)
        sr = tl.where(cm, tl.log(r) + g, float("-inf"))
        sp_ = tl.where(cm, tl.log(p) + g, float("-inf"))
        cr = tl.max(sr, 0)
        arg_r = tl.where(cr > best_r, v0 + tl.argmax(sr, 0, tie_break_left=True), arg_r)
        best_r = tl.maximum(best_r, cr)
        cp = tl.max(sp_, 0)
        arg_p = tl.where(cp > best_p, v0 + tl.argmax(sp_, 0, tie_break_left=True), arg_p)
        best_p = tl.maximum(best_p, cp)
    return mass, best_r, arg_r, best_p, arg_p


@triton.jit
def _row_params(temperature, seed, start, b):
    st = tl.load(start + b)
    sd = tl.load(seed + b)
    temp = tl.load(temperature + b).to(tl.float32)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, tl.maximum(temp, 1e-6))
    return st, sd, greedy, t


# --------------------------------------------------------------------------------------------
# Split schedule


@triton.jit
def rejection_stats_kernel(target_logits, draft_logits, temperature, start, part_m, part_s, part_arg,
                           N, V, CHUNK, BLOCK_V: tl.constexpr):
    """Grid (B * (2N+1), S). Row r of batch row b: target row r for r <= N, else draft row
    r - N - 1. part_m, part_s, part_arg [B, 2N+1, S]: statistics of x / T over chunk s."""
    br = tl.program_id(0)
    s = tl.program_id(1)
    b = br // (2 * N + 1)
    r = br % (2 * N + 1)
    temp = tl.load(temperature + b).to(tl.float32)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, tl.maximum(temp, 1e-6))
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    live = tl.load(start + b) >= 0
    m = tl.full([], float("-inf"), tl.float32)
    ssum = tl.zeros([], tl.float32)
    arg = lo
    if live:
        if r <= N:
            m, ssum, arg = _chunk_stats(target_logits + (b.to(tl.int64) * (N + 1) + r) * V, lo, hi, t, greedy,
                                         BLOCK_V)
        elif greedy == 0:                                    # greedy rows never look at q
            m, ssum = _chunk_softmax(draft_logits + (b.to(tl.int64) * N + r - N - 1) * V, lo, hi, t, BLOCK_V)
    off = br.to(tl.int64) * tl.num_programs(1) + s
    tl.store(part_m + off, m)
    tl.store(part_s + off, ssum)
    tl.store(part_arg + off, arg)


@triton.jit
def _merge_stats(part_m, part_s, part_arg, rows, rmask, S, BLOCK_S: tl.constexpr):
    """Merge the S chunk statistics of each of ``rows`` ([BLOCK_J] workspace rows) -> (m, s, arg)."""
    cs = tl.arange(0, BLOCK_S)
    off = rows.to(tl.int64)[:, None] * S + cs[None, :]
    msk = rmask[:, None] & (cs[None, :] < S)
    m_i = tl.load(part_m + off, mask=msk, other=float("-inf"))
    s_i = tl.load(part_s + off, mask=msk, other=0.0)
    a_i = tl.load(part_arg + off, mask=msk, other=INT_MAX)
    m = tl.max(m_i, 1)
    s = tl.sum(s_i * tl.exp(m_i - _finite_or_zero(m)[:, None]), 1)
    arg = tl.min(tl.where(m_i == m[:, None], a_i, INT_MAX), 1)
    return m, s, arg


@triton.jit
def rejection_residual_kernel(target_logits, draft_tokens, draft_logits, temperature, seed, start,
                              part_m, part_s, part_arg, res_val, res_arg, accepted_out, next_out,
                              N, V, S, CHUNK, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    """Grid (B, S2). res_val [B, S2, 3] (mass, best residual score, best p score), res_arg
    [B, S2, 2]: partials over chunk c of row a. Program 0 writes accepted and the greedy / inert
    next token."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    st, sd, greedy, t = _row_params(temperature, seed, start, b)
    live = st >= 0
    sampled = live & (greedy == 0)
    R = 2 * N + 1
    jj = tl.arange(0, BLOCK_J)
    # (scalar flags enter vector masks through the bounds: the interpreter cannot mix them with &)
    mp, sp, argp = _merge_stats(part_m, part_s, part_arg, b * R + jj, jj <= N, S, BLOCK_S)    # rows 0..N
    dm = jj < N
    dm_sampled = jj < tl.where(sampled, N, 0)
    mq, sq, _ = _merge_stats(part_m, part_s, part_arg, b * R + N + 1 + jj, dm_sampled, S, BLOCK_S)

    x = tl.maximum(tl.load(draft_tokens + b * N + jj, mask=dm, other=0), 0)              # [BLOCK_J]
    lx = tl.load(target_logits + (b.to(tl.int64) * (N + 1) + jj) * V + x,
                 mask=jj < tl.where(live, N, 0), other=0.0)
    zx = tl.load(draft_logits + (b.to(tl.int64) * N + jj) * V + x, mask=dm_sampled, other=0.0)
    px = tl.exp(lx.to(tl.float32) / t - mp) / sp
    qx = tl.exp(zx.to(tl.float32) / t - mq) / sq
    u = uniform(row_key(sd, st + 1 + jj, STREAM_ACCEPT), tl.zeros([BLOCK_J], tl.int32))
    ok = tl.where(greedy, x == argp, u * qx < px)
    a = tl.min(tl.where(dm & (ok == 0), jj, N), 0)                 # first rejection, or N

    at_a = jj == a
    if c == 0:
        tl.store(accepted_out + b, tl.where(live, a, 0).to(tl.int64))
        greedy_next = tl.sum(tl.where(at_a, argp, 0), 0)
        tl.store(next_out + b, tl.where(live & greedy, greedy_next, -1).to(tl.int64))

    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    if sampled:
        mpa = tl.max(tl.where(at_a, mp, float("-inf")), 0)
        spa = tl.sum(tl.where(at_a, sp, 0.0), 0)
        mqa = tl.max(tl.where(at_a & dm, mq, float("-inf")), 0)
        sqa = tl.sum(tl.where(at_a & dm, sq, 0.0), 0)
        lrow = target_logits + (b.to(tl.int64) * (N + 1) + a) * V
        qrow = draft_logits + (b.to(tl.int64) * N + tl.maximum(tl.minimum(a, N - 1), 0)) * V
        key = row_key(sd, st + a + 1, STREAM_RESIDUAL)
        mass, best_r, arg_r, best_p, arg_p = _residual_chunk(lrow, qrow, lo, hi, tl.where(a < N, hi, lo),
                                                             t, mpa, spa, mqa, sqa, key, BLOCK_V)
    else:
        mass = tl.zeros([], tl.float32)
        best_r = tl.full([], float("-inf"), tl.float32)
        best_p = tl.full([], float("-inf"), tl.float32)
        arg_r = lo
        arg_p = lo
    slot = b.to(tl.int64) * tl.num_programs(1) + c
    tl.store(res_val + slot * 3, mass)
    tl.store(res_val + slot * 3 + 1, best_r)
    tl.store(res_val + slot * 3 + 2, best_p)
    tl.store(res_arg + slot * 2, arg_r)
    tl.store(res_arg + slot * 2 + 1, arg_p)


@triton.jit
def rejection_finish_kernel(temperature, start, res_val, res_arg, next_out, S2, BLOCK_S: tl.constexpr):
    """Grid (B,): the sampled next token of a live sampled row from its S2 residual partials."""
    b = tl.program_id(0)
    live = tl.load(start + b) >= 0
    if live & (tl.load(temperature + b).to(tl.float32) > 0):
        cs = tl.arange(0, BLOCK_S)
        cm = cs < S2
        slot = b.to(tl.int64) * S2 + cs
        mass = tl.sum(tl.load(res_val + slot * 3, mask=cm, other=0.0), 0)
        vr = tl.load(res_val + slot * 3 + 1, mask=cm, other=float("-inf"))
        vp = tl.load(res_val + slot * 3 + 2, mask=cm, other=float("-inf"))
        ar = tl.load(res_arg + slot * 2, mask=cm, other=INT_MAX)
        ap = tl.load(res_arg + slot * 2 + 1, mask=cm, other=INT_MAX)
        arg_r = tl.min(tl.where(vr == tl.max(vr, 0), ar, INT_MAX), 0)
        arg_p = tl.min(tl.where(vp == tl.max(vp, 0), ap, INT_MAX), 0)
        tl.store(next_out + b, tl.where(mass > 1e-12, arg_r, arg_p).to(tl.int64))


# --------------------------------------------------------------------------------------------
# Row schedule (TensorRT AOT entry)


@triton.jit
def rejection_sample_kernel(target_logits, draft_tokens, draft_logits, temperature, seed, start,
                            accepted_out, next_out, N, V, BLOCK_V: tl.constexpr):
    """Grid (B,): one program per row, no workspace."""
    b = tl.program_id(0)
    st, sd, greedy, t = _row_params(temperature, seed, start, b)
    L = target_logits + b.to(tl.int64) * (N + 1) * V
    Z = draft_logits + b.to(tl.int64) * N * V

    j = 0
    ok = st >= 0
    while ok & (j < N):
        x = tl.maximum(tl.load(draft_tokens + b * N + j), 0)
        mp, sp, argp = _chunk_stats(L + j * V, 0, V, t, greedy, BLOCK_V)
        mq, sq = _chunk_softmax(Z + j * V, 0, tl.where(greedy, 0, V), t, BLOCK_V)
        px = tl.exp(tl.load(L + j * V + x).to(tl.float32) / t - mp) / sp
        qx = tl.exp(tl.load(Z + j * V + x).to(tl.float32) / t - mq) / sq
        u = uniform(row_key(sd, st + 1 + j, STREAM_ACCEPT), tl.zeros([], tl.int32))
        ok = tl.where(greedy, x == argp, u * qx < px)
        j += tl.where(ok, 1, 0)
    a = j                                                        # accepted drafts

    mp, sp, argp = _chunk_stats(L + a * V, 0, V, t, greedy, BLOCK_V)
    live = st >= 0
    nxt = argp
    if live & (greedy == 0):
        qrow = Z + tl.maximum(tl.minimum(a, N - 1), 0) * V
        qhi = tl.where(a < N, V, 0)                              # q = 0 at the bonus row
        mq, sq = _chunk_softmax(qrow, 0, qhi, t, BLOCK_V)
        key = row_key(sd, st + a + 1, STREAM_RESIDUAL)
        mass, _, arg_r, _, arg_p = _residual_chunk(L + a * V, qrow, 0, V, qhi, t, mp, sp, mq, sq, key,
                                                   BLOCK_V)
        nxt = tl.where(mass > 1e-12, arg_r, arg_p)
    tl.store(accepted_out + b, tl.where(live, a, 0).to(tl.int64))
    tl.store(next_out + b, tl.where(live, nxt, -1).to(tl.int64))


# --------------------------------------------------------------------------------------------
# Launch configuration

# Defaults of the split schedule (benchmarks/tune_plugins.py measures alternatives):
# block_v: entries per load; programs_per_sm: target programs per SM of each launch (8 programs of
# 8 warps fill an SM's 64 warps, ~8 KB of fp32 loads in flight each); max_tiles: at most this many
# BLOCK_V tiles per program, so large batches still get many small programs (short tail).
REJECTION_DEFAULTS = dict(block_v=2048, programs_per_sm=8, max_tiles=8, num_warps=8)


def _chunk_tiles(rows: int, tiles: int, target: int, max_tiles: int, splits: int | None) -> int:
    """BLOCK_V tiles per vocabulary chunk: ``splits`` chunks per row when given, else chunks small
    enough that ``rows`` rows give about ``target`` programs, at most ``max_tiles`` tiles each."""
    if splits:
        return triton.cdiv(tiles, max(1, min(splits, tiles)))
    want = max(triton.cdiv(target, max(rows, 1)), triton.cdiv(tiles, max_tiles))
    return max(1, tiles // want)


def rejection_config(B, N: int, V: int, device: torch.device, **overrides) -> dict:
    """Launch config of the split schedule from shapes: block_v, num_warps, and the vocabulary
    chunks (in BLOCK_V tiles) of the statistics pass (chunk_tiles) and of the residual pass
    (res_chunk_tiles). ``overrides`` (not None) replace defaults; ``splits`` / ``res_splits`` ask
    for that many chunks per row."""
    cfg = {**REJECTION_DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    block_v = min(cfg["block_v"], pow2(V, 16))
    tiles = triton.cdiv(V, block_v)
    target = cfg["programs_per_sm"] * num_sms(device)
    rows = B if isinstance(B, int) else 8                    # symbolic batch (export): a fixed guess
    cfg["chunk_tiles"] = _chunk_tiles(rows * (2 * N + 1), tiles, target, cfg["max_tiles"], cfg.get("splits"))
    cfg["res_chunk_tiles"] = _chunk_tiles(rows, tiles, target, cfg["max_tiles"], cfg.get("res_splits"))
    cfg["block_v"] = block_v
    return cfg


def rejection_sample_triton(target_logits: Tensor, draft_tokens: Tensor, draft_logits: Tensor,
                            temperature: Tensor, seed: Tensor, start: Tensor, schedule: str = "split",
                            block_v: int | None = None, splits: int | None = None,
                            res_splits: int | None = None, num_warps: int | None = None,
                            programs_per_sm: int | None = None,
                            max_tiles: int | None = None) -> tuple[Tensor, Tensor]:
    """Same contract as ``rejection_sample_ref``. ``schedule="split"`` (default) runs the three
    launches of the module doc, with launch parameters from ``rejection_config``; ``"row"`` the
    one-program-per-row kernel of the TensorRT AOT entry."""
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    if schedule not in ("split", "row"):
        raise ValueError(f"rejection_sample: schedule must be 'split' or 'row', got {schedule!r}")
    if draft_tokens.shape != (B, N) or (N and draft_logits.shape != (B, N, V)):
        raise ValueError(f"rejection_sample: draft_tokens {tuple(draft_tokens.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} do not match target_logits {tuple(target_logits.shape)}")
    accepted = torch.empty(B, dtype=torch.int64, device=dev)
    nxt = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return accepted, nxt
    logits = target_logits.contiguous()
    z = draft_logits.contiguous() if N else logits            # N = 0: never read, any valid row
    rowargs = (temperature.contiguous(), seed.contiguous(), start.contiguous())
    tokens = draft_tokens.contiguous()
    cfg = rejection_config(B, N, V, dev, block_v=block_v, splits=splits, res_splits=res_splits,
                           num_warps=num_warps, programs_per_sm=programs_per_sm, max_tiles=max_tiles)
    if schedule == "row":
        launcher(rejection_sample_kernel)[(B,)](logits, tokens, z, *rowargs, accepted, nxt, N, V,
                                                BLOCK_V=cfg["block_v"], num_warps=cfg["num_warps"])
        return accepted, nxt
    bv, warps = cfg["block_v"], cfg["num_warps"]
    chunk, chunk2 = cfg["chunk_tiles"] * bv, cfg["res_chunk_tiles"] * bv
    S, S2 = triton.cdiv(V, chunk), triton.cdiv(V, chunk2)
    R = 2 * N + 1
    part_m = torch.empty((B, R, S), dtype=torch.float32, device=dev)
    part_s = torch.empty((B, R, S), dtype=torch.float32, device=dev)
    part_arg = torch.empty((B, R, S), dtype=torch.int32, device=dev)
    res_val = torch.empty((B, S2, 3), dtype=torch.float32, device=dev)
    res_arg = torch.empty((B, S2, 2), dtype=torch.int32, device=dev)
    temp, sd, st = rowargs
    launcher(rejection_stats_kernel)[(B * R, S)](
        logits, z, temp, st, part_m, part_s, part_arg, N, V, chunk, BLOCK_V=bv, num_warps=warps)
    launcher(rejection_residual_kernel)[(B, S2)](
        logits, tokens, z, temp, sd, st, part_m, part_s, part_arg, res_val, res_arg, accepted, nxt,
        N, V, S, chunk2, BLOCK_J=pow2(N + 1), BLOCK_S=pow2(S), BLOCK_V=bv, num_warps=warps)
    launcher(rejection_finish_kernel)[(B,)](temp, st, res_val, res_arg, nxt, S2, BLOCK_S=pow2(S2),
                                           num_warps=1)
    return accepted, nxt
