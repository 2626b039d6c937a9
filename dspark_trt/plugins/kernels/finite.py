"""Which rows of logits are finite (``plugins.rows_finite`` on a GPU): the verify and AR steps flag
a row whose target logits hold NaN or Inf. ``torch.isfinite(x).all(-1)`` is four full-size
elementwise kernels and a reduction over the logits (H100, Qwen3-8B vocabulary, batch-64 verify:
~0.26 ms of a round); here one read of the logits and a reduction of the partials:
* grid (R, S): program (r, s) writes whether slice s of row r is finite (uint8 partials [R, S]);
* ``partials.view(B, -1).all(-1)``: a leading row is finite when every slice of its rows is.
S spreads a row over the SMs at small row counts (about four programs per SM in all).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, row_slices

BLOCK_V = 2048


@triton.jit
def finite_slices_kernel(x, part, V, CHUNK, S, stride_r, BLOCK_V: tl.constexpr):
    """Grid (R, S): part[r, s] = 1 when columns [s * CHUNK, (s + 1) * CHUNK) of row r are finite."""
    r, s = tl.program_id(0), tl.program_id(1)
    row = x + r.to(tl.int64) * stride_r
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    bad = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        v = tl.load(row + cols, mask=cols < hi, other=0.0).to(tl.float32)
        bad = bad | ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)          # NaN, +-Inf
    tl.store(part + r * S + s, (tl.max(bad, 0) == 0).to(tl.uint8))


def rows_finite_triton(x: Tensor, slices: int | None = None) -> Tensor:
    """x [B, ..., V] -> [B] bool: every entry of x[b] finite. ``slices``: per row (tests)."""
    B, V = x.shape[0], x.shape[-1]
    rows = x.reshape(-1, V)                                         # a view where x is contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    if R == 0 or V == 0:
        return torch.ones(B, dtype=torch.bool, device=x.device)
    S, chunk = row_slices(R, V, BLOCK_V, 4, x.device, slices)      # about four programs per SM in all
    part = torch.empty((R, S), dtype=torch.uint8, device=x.device)
    launcher(finite_slices_kernel)[(R, S)](rows, part, V, chunk, S, rows.stride(0), BLOCK_V=BLOCK_V,
                                           num_warps=4)
    return part.view(torch.bool).view(B, -1).all(-1)             # bool (``all`` of uint8 stays uint8)
