"""Triton kernel of ``dspark::rejection_sample``: one program per row, no host round trip.

For j = 0.. while accepted: streaming softmax statistics of ``L_j / T`` and ``z_j / T`` over the
vocabulary (max, sum of exponentials, first argmax), then the acceptance test of draft ``x_j``
(greedy: ``x_j == argmax L_j``; sampled: ``u · q(x_j) < p(x_j)``). Then one pass over row ``a``
(the first rejection, or the bonus row N) computes the residual ``max(p - q, 0)``, its mass, and
the Gumbel argmax of both ``log(residual)`` and ``log(p)`` (the fallback when the mass is 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import STREAM_ACCEPT, STREAM_RESIDUAL, gumbel, launcher, row_key, uniform


@triton.jit
def _row_stats(ptr, V, temp, BLOCK_V: tl.constexpr):
    """max m, sum of exp(x / t - m), first argmax of one row [V] of logits."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        cmax = tl.max(x, 0)
        carg = tl.argmax(x, 0, tie_break_left=True)
        arg = tl.where(cmax > best, v0 + carg, arg)
        best = tl.maximum(best, cmax)
        xs = x / temp
        m_new = tl.maximum(m, tl.max(xs, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xs - m_new), 0)
        m = m_new
    return m, s, arg


@triton.jit
def rejection_sample_kernel(target_logits, draft_tokens, draft_logits, temperature, seed, start,
                            accepted_out, next_out, N, V, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    st = tl.load(start + b)
    sd = tl.load(seed + b)
    temp = tl.load(temperature + b).to(tl.float32)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, tl.maximum(temp, 1e-6))
    L = target_logits + b.to(tl.int64) * (N + 1) * V
    Z = draft_logits + b.to(tl.int64) * N * V

    j = 0
    ok = st >= 0
    while ok & (j < N):
        x = tl.maximum(tl.load(draft_tokens + b * N + j), 0)
        mp, sp, argp = _row_stats(L + j * V, V, t, BLOCK_V)
        mq, sq, argq = _row_stats(Z + j * V, V, t, BLOCK_V)
        px = tl.exp(tl.load(L + j * V + x).to(tl.float32) / t - mp) / sp
        qx = tl.exp(tl.load(Z + j * V + x).to(tl.float32) / t - mq) / sq
        u = uniform(row_key(sd, st + 1 + j, STREAM_ACCEPT), tl.zeros([], tl.int32))
        ok = tl.where(greedy, x == argp, u * qx < px)
        j += tl.where(ok, 1, 0)
    a = j                                                        # accepted drafts

    mp, sp, argp = _row_stats(L + a * V, V, t, BLOCK_V)
    has_q = a < N
    qrow = Z + tl.maximum(tl.minimum(a, N - 1), 0) * V
    mq, sq, _ = _row_stats(qrow, V, t, BLOCK_V)
    key = row_key(sd, st + a + 1, STREAM_RESIDUAL)
    mass = tl.zeros([], tl.float32)
    best_r = tl.full([], float("-inf"), tl.float32)
    arg_r = tl.zeros([], tl.int32)
    best_p = tl.full([], float("-inf"), tl.float32)
    arg_p = tl.zeros([], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cm = cols < V
        p = tl.exp(tl.load(L + a * V + cols, mask=cm, other=float("-inf")).to(tl.float32) / t - mp) / sp
        q = tl.exp(tl.load(qrow + cols, mask=cols < tl.where(has_q, V, 0), other=float("-inf")).to(tl.float32) / t - mq) / sq
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
    sampled = tl.where(mass > 1e-12, arg_r, arg_p)
    nxt = tl.where(greedy, argp, sampled)
    live = st >= 0
    tl.store(accepted_out + b, tl.where(live, a, 0).to(tl.int64))
    tl.store(next_out + b, tl.where(live, nxt, -1).to(tl.int64))


def rejection_sample_triton(target_logits: Tensor, draft_tokens: Tensor, draft_logits: Tensor,
                            temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    B, N1, V = target_logits.shape
    accepted = torch.empty(B, dtype=torch.int64, device=target_logits.device)
    nxt = torch.empty(B, dtype=torch.int64, device=target_logits.device)
    if B:
        logits = target_logits.contiguous()
        z = draft_logits.contiguous() if N1 > 1 else logits     # N = 0: never read, any valid row
        launcher(rejection_sample_kernel)[(B,)](
            logits, draft_tokens.contiguous(), z,
            temperature.contiguous(), seed.contiguous(), start.contiguous(), accepted, nxt,
            N1 - 1, V, BLOCK_V=2048 if V >= 2048 else max(16, triton.next_power_of_2(V)), num_warps=8)
    return accepted, nxt
