"""Device dispatch of the ``dspark`` ops: CUDA tensors run the Triton kernel, anything else (CPU CI,
CPU AOTInductor builds, machines without Triton) runs the PyTorch reference.

The ops are registered with ``torch.library.triton_op``: ``torch.export`` keeps each one as a
single node, and AOTInductor compiles the Triton kernels of a CUDA graph into the package (on CPU
it compiles the reference body instead, since inductor cannot build Triton kernels there).
"""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: Tensor) -> bool:
    """True when the op should run its Triton kernel on this tensor's device."""
    return HAVE_TRITON and x.is_cuda


def all_greedy_eager_cpu(temperature: Tensor) -> bool:
    """True when every row is greedy (temperature <= 0) and the reference runs eagerly on a CPU:
    the references may then skip the sampling arithmetic (softmax, counter-based noise), whose
    greedy rows are discarded anyway. Never under tracing or export (a data-dependent branch),
    and never on a GPU (the check reads the tensor on the host)."""
    if type(temperature) is not torch.Tensor or temperature.device.type != "cpu":
        return False                                  # fake / functional / proxy tensors, GPUs
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    if get_proxy_mode() is not None:                  # make_fx / export tracing with real tensors
        return False
    return bool((temperature <= 0).all())
