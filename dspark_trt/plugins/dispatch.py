"""Device dispatch of the ``dspark`` ops: CUDA tensors run the Triton kernel, anything else (CPU CI,
CPU AOTInductor builds, machines without Triton) runs the PyTorch reference.

The ops are registered with ``torch.library.triton_op``: ``torch.export`` keeps each one as a
single node, and AOTInductor compiles the Triton kernels of a CUDA graph into the package (on CPU
it compiles the reference body instead, since inductor cannot build Triton kernels there).
"""
from __future__ import annotations

import importlib.util

from torch import Tensor

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: Tensor) -> bool:
    """True when the op should run its Triton kernel on this tensor's device."""
    return HAVE_TRITON and x.is_cuda
