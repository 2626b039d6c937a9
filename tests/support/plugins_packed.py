"""Triton kernels over ``markov._pack_best`` for ``plugins_cases.packed_argmax_case`` (a module of
their own: it imports Triton, which ``plugins_cases`` must load without)."""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_trt.plugins.kernels.markov_exact import _pack_best, _unpack_index


@triton.jit
def fold_packed(scores, slot, M, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scores + i, mask=i < M)
    tl.atomic_max(slot + 0 * i, _pack_best(s, i), mask=i < M, sem="relaxed")


@triton.jit
def unpack_packed(slot, out):
    tl.store(out + tl.program_id(0), _unpack_index(tl.load(slot + tl.program_id(0))))
