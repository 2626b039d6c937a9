"""L2 prefetch of a weight the next kernels will read (issue #21).

A decode step alternates weight-streaming GEMVs with short, latency-bound kernels (norms, RoPE,
the KV-cache write, attention at batch 1) during which HBM is nearly idle. ``l2_prefetch(w)``
issues sm_90 bulk prefetches (``cp.async.bulk.prefetch.L2``: the copy engine fetches a byte range
into L2, nothing is waited for) of a tensor's bytes and returns at once; launched right after the
q/k/v projection, the o projection's weights arrive in L2 while the attention kernels run, and its
GEMV then reads them at L2 instead of HBM speed. A hint only: results never depend on it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher

CHUNK = 65536                  # bytes per bulk prefetch (a multiple of 16)
PER_PROGRAM = 32               # prefetches per program: one per thread of its one warp


@triton.jit
def l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Grid (cdiv(nbytes, CHUNK * PER_PROGRAM),). base: the tensor viewed as bytes (16-aligned),
    nbytes: a multiple of 16."""
    off = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(w: Tensor) -> None:
    """Start fetching ``w``'s bytes (contiguous, CUDA, sm_90+) into L2; returns immediately."""
    nbytes = (w.numel() * w.element_size()) // 16 * 16
    if nbytes == 0:
        return
    grid = (triton.cdiv(nbytes, CHUNK * PER_PROGRAM),)
    launcher(l2_prefetch_kernel)[grid](w.view(torch.uint8).view(-1), nbytes, CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM,
                                       num_warps=1)
