"""Opt-in L2 prefetch of the next projection's weights during latency-bound kernels (issue #21).

``prefetch_weight(w)`` launches ``kernels.l2_prefetch`` (sm_90 bulk prefetch into L2, a hint that
never changes a result) when ``DSPARK_L2_PREFETCH=1`` (read at call time), on CUDA devices of
compute capability >= 9 with Triton, outside torch.compile / export traces (the eager attention
island of ``LLM``'s modules calls it; engines do not have it yet). Anything else: nothing.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .dispatch import HAVE_TRITON

ENV = "DSPARK_L2_PREFETCH"


def l2_prefetch_enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def prefetch_weight(w: Tensor | None) -> bool:
    """Start fetching ``w`` into L2 where that is possible and enabled; True if launched."""
    if w is None or not (l2_prefetch_enabled() and HAVE_TRITON and w.is_cuda and w.is_contiguous()):
        return False
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or is_fake(w):
        return False                                    # a trace: nothing to fetch
    if torch.cuda.get_device_capability(w.device)[0] < 9:
        return False
    from .kernels.l2_prefetch import l2_prefetch
    l2_prefetch(w)
    return True
