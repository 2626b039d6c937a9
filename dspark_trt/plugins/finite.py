"""``rows_finite``: which leading rows of a tensor hold only finite values (the steps' check of the
target logits; on a GPU one Triton read of the logits, ``kernels/finite.py``)."""
from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import use_triton


def rows_finite(x: Tensor) -> Tensor:
    """x [B, ..., V] -> [B] bool: every entry of ``x[b]`` is finite (no NaN, no +-Inf)."""
    if use_triton(x):
        from .kernels.finite import rows_finite_triton
        return rows_finite_triton(x)
    return rows_finite_ref(x)


def rows_finite_ref(x: Tensor) -> Tensor:
    """``rows_finite`` in torch ops (the reference; CPU)."""
    return torch.isfinite(x).flatten(1).all(-1)
