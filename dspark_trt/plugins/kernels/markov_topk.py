"""Triton kernels and launcher of ``dspark::markov_sample_topk``: a candidate-restricted proposal
(fast mode; NOT the exact full-vocabulary sampler of ``markov_exact.py``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import STREAM_DRAFT, gumbel, launcher, pow2, row_key


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
