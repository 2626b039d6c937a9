"""Triton kernel of ``dspark::noncausal_swa_indices``: one program per row builds the index list
``[max(P - W, 0), P + N)`` mapped through the block table, pads it with -1 and copies it to the
N queries of the row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, pow2


@triton.jit
def noncausal_swa_indices_kernel(start, block_table, idx_out, lens_out,
                                 P, N, PAGE_SIZE, WINDOW, WIDTH, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.load(start + b)
    live = s >= 0
    first = tl.maximum(s - WINDOW, 0)
    count = tl.where(live, s + N - first, 0)
    for c0 in range(0, WIDTH, BLOCK):
        off = c0 + tl.arange(0, BLOCK)
        cmask = off < WIDTH
        pos = first + off
        page = tl.minimum(pos // PAGE_SIZE, P - 1)
        row = tl.load(block_table + b * P + page, mask=cmask & (off < count), other=-1)
        idx = tl.where(off < count, row * PAGE_SIZE + pos % PAGE_SIZE, -1).to(tl.int32)
        for n in range(0, N):
            tl.store(idx_out + (b * N + n).to(tl.int64) * WIDTH + off, idx, mask=cmask)
    for n in range(0, N):
        tl.store(lens_out + b * N + n, count.to(tl.int32))


def noncausal_swa_indices_triton(start: Tensor, block_table: Tensor, num_queries: int, page_size: int,
                                 window: int, width: int) -> tuple[Tensor, Tensor]:
    B = start.shape[0]
    idx = torch.empty((B, num_queries, width), dtype=torch.int32, device=start.device)
    lens = torch.empty((B, num_queries), dtype=torch.int32, device=start.device)
    if B and num_queries:
        launcher(noncausal_swa_indices_kernel)[(B,)](
            start.contiguous(), block_table.contiguous(), idx, lens, block_table.shape[1],
            num_queries, page_size, window, width, BLOCK=min(pow2(width), 1024))
    return idx, lens
