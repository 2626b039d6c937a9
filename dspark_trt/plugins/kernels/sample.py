"""One token per row of logits [B, V] (``rejection_sample.sample_tokens`` on a GPU, issue #21):
argmax at T = 0, else the Gumbel-max sample ``argmax(logits / T + g)`` with the loop's noise (seed,
position, ``STREAM_RESIDUAL``; ``rng.gumbel``).

The torch path hashes a [B, V] int64 counter through ~70 elementwise kernels (on an H100 at
Qwen3-8B's vocabulary: ~90 us of the AR step at batch 1, ~290 us at 16,
profile-ar-b*-NVIDIA-H100-5ffb290); here two launches:
* grid (B, S): each program the first maximum of its slice of the row (greedy rows skip the noise);
* grid (B,): the row's first maximum over its S slices (``torch.argmax``'s first index on ties).
S spreads a row over the SMs at small batches (about two programs per SM in all).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import STREAM_RESIDUAL, gumbel, launcher, row_key, row_slices

INT_MAX = tl.constexpr(2**31 - 1)
BLOCK_V = 1024


@triton.jit
def sample_slices_kernel(logits, temperature, seed, position, part_v, part_a, V, CHUNK, S, stride_b,
                         BLOCK_V: tl.constexpr):
    """Grid (B, S): the first max of ``logits[b] (/ T + g)`` over columns [s * CHUNK, (s + 1) * CHUNK)."""
    b, s = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperature + b).to(tl.float32)
    greedy = t <= 0
    inv_t = tl.math.div_rn(1.0, tl.maximum(t, 1e-6))          # as the reference: 1 / clamp(T), rounded
    key = row_key(tl.load(seed + b), tl.load(position + b), STREAM_RESIDUAL)
    row = logits + b.to(tl.int64) * stride_b
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int32) + lo            # a slice of -inf only: its first column, as torch.argmax
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = cols < hi
        x = tl.load(row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if not greedy:
            x = tl.where(inside, x * inv_t + gumbel(key, cols), float("-inf"))
        cmax = tl.max(x, 0)
        carg = v0 + tl.argmax(x, 0, tie_break_left=True)
        arg = tl.where(cmax > m, carg, arg)
        m = tl.maximum(m, cmax)
    tl.store(part_v + b * S + s, m)
    tl.store(part_a + b * S + s, arg)


@triton.jit
def sample_merge_kernel(part_v, part_a, out, S, BLOCK_S: tl.constexpr):
    """Grid (B,): the first maximum over the row's S slices -> out[b] (int64)."""
    b = tl.program_id(0)
    cs = tl.arange(0, BLOCK_S)
    v = tl.load(part_v + b * S + cs, mask=cs < S, other=float("-inf"))
    a = tl.load(part_a + b * S + cs, mask=cs < S, other=INT_MAX)
    best = tl.min(tl.where(v == tl.max(v, 0), a, INT_MAX), 0)
    tl.store(out + b, best.to(tl.int64))


def sample_tokens_triton(logits: Tensor, temperature: Tensor, seed: Tensor, position: Tensor,
                         block_v: int = BLOCK_V, slices: int | None = None) -> Tensor:
    """logits [B, V] (any float dtype), temperature [B], seed [B] int64, position [B] int64 ->
    [B] int64 tokens, as ``rejection_sample.sample_tokens``. ``block_v`` / ``slices``: the tile and
    the slices per row (default: about two programs per SM in all, ``row_slices``; tests)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    S, chunk = row_slices(B, V, block_v, 2, logits.device, slices)
    part_v = torch.empty(B * S, dtype=torch.float32, device=logits.device)
    part_a = torch.empty(B * S, dtype=torch.int32, device=logits.device)
    launcher(sample_slices_kernel)[(B, S)](logits, temperature, seed, position, part_v, part_a, V, chunk, S,
                                           logits.stride(0), BLOCK_V=block_v, num_warps=4)
    launcher(sample_merge_kernel)[(B,)](part_v, part_a, out, S, BLOCK_S=triton.next_power_of_2(S), num_warps=4)
    return out
