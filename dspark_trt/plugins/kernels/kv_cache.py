"""Triton kernel of ``dspark::kv_cache_write``: one program per token, all heads at once.

Inert tokens (position < 0, page id < 0, position beyond the table) load and store nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, pow2


@triton.jit
def kv_cache_write_kernel(k_cache, v_cache, k, v, block_table, positions,
                          T, P, PAGE_SIZE, ROW,              # ROW = Hkv * D elements per token
                          BLOCK: tl.constexpr):
    tok = tl.program_id(0)                                   # b * T + t
    b = tok // T
    pos = tl.load(positions + tok)
    col = tl.minimum(tl.maximum(pos, 0) // PAGE_SIZE, P - 1)
    page = tl.load(block_table + b * P + col)
    valid = (pos >= 0) & (page >= 0) & (pos < P * PAGE_SIZE)
    dst = (page * PAGE_SIZE + tl.maximum(pos, 0) % PAGE_SIZE).to(tl.int64) * ROW
    src = tok.to(tl.int64) * ROW
    n = tl.where(valid, ROW, 0)                              # inert: every access masked off
    for c0 in range(0, ROW, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(k_cache + dst + offs, tl.load(k + src + offs, mask=m).to(k_cache.dtype.element_ty), mask=m)
        tl.store(v_cache + dst + offs, tl.load(v + src + offs, mask=m).to(v_cache.dtype.element_ty), mask=m)


def kv_cache_write_triton(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                          positions: Tensor) -> None:
    """Same contract as ``kv_cache_write_ref``; caches must be contiguous (written in place)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_cache_write: the KV caches must be contiguous")
    B, T, Hkv, D = k.shape
    row = Hkv * D
    if B * T * row == 0:
        return
    launcher(kv_cache_write_kernel)[(B * T,)](
        k_cache, v_cache, k.contiguous(), v.contiguous(), block_table.contiguous(),
        positions.contiguous(), T, block_table.shape[1], k_cache.shape[1], row,
        BLOCK=min(pow2(row), 2048))
