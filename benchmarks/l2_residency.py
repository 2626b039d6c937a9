"""Keep part of one weight resident in the GPU's L2 across kernels (CUDA access-policy window).

The exact Markov sampler reads the whole W2 [V, r] once per draft step (78 MB for Qwen3-8B, more
than the H200's 60 MB L2), so a plain sweep misses L2 every step. A persisting access-policy window
over W2 with ``hitRatio = resident / W2 bytes`` marks that share of W2's cache lines persisting:
they survive the other steps' streaming reads (and the target's weight stream between rounds), and
each later step reads them from L2. The set-aside L2 (``cudaLimitPersistingL2CacheSize``) is used
by normal accesses while no persisting line needs it.

A stream's window is inherited by kernels launched on it and by kernel nodes captured from it
(``graph_windows`` checks). Used and measured by ``benchmarks/markov_l2.py`` (so it lives next to
it); the runtime does not set it yet (its effect on the target step, which loses that share of L2,
is not measured).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.runtime.cuda_graphs import cuda_check


@dataclass(frozen=True)
class L2Window:
    """What ``set_window`` applied: the window [base, base + num_bytes), the share of its lines
    marked persisting, and the device's persisting set-aside."""
    base_ptr: int
    num_bytes: int
    hit_ratio: float
    persisting_limit_bytes: int

    @property
    def resident_bytes(self) -> int:
        return int(self.num_bytes * self.hit_ratio)


def _rt():
    from cuda.bindings import runtime as rt
    return rt


def l2_info(device: torch.device | int | None = None) -> dict:
    """L2 size, the largest persisting set-aside and the largest window of ``device`` (bytes)."""
    rt = _rt()
    index = torch.device("cuda", device).index if isinstance(device, int) else getattr(device, "index", None)
    index = torch.cuda.current_device() if index is None else index
    attr = lambda a: int(cuda_check(rt.cudaDeviceGetAttribute(a, index), f"cudaDeviceGetAttribute({a.name})"))  # noqa: E731
    return {"l2_bytes": attr(rt.cudaDeviceAttr.cudaDevAttrL2CacheSize),
            "max_persisting_bytes": attr(rt.cudaDeviceAttr.cudaDevAttrMaxPersistingL2CacheSize),
            "max_window_bytes": attr(rt.cudaDeviceAttr.cudaDevAttrMaxAccessPolicyWindowSize)}


def set_window(stream: torch.cuda.Stream, weight: torch.Tensor, resident_bytes: int) -> L2Window:
    """Mark ``resident_bytes`` of ``weight`` (spread over it by the hit ratio) persisting for kernels
    launched on / captured from ``stream``; the rest of the window streams. Clamped to what the
    device allows. ``resident_bytes <= 0`` clears the stream's window."""
    if not weight.is_cuda or not weight.is_contiguous():
        raise ValueError(f"set_window: the weight must be a contiguous CUDA tensor, got a "
                         f"{'contiguous' if weight.is_contiguous() else 'strided'} tensor on {weight.device}")
    rt = _rt()
    if resident_bytes <= 0:
        clear_window(stream)
        return L2Window(weight.data_ptr(), 0, 0.0, 0)
    info = l2_info(weight.device)
    limit = min(int(resident_bytes), info["max_persisting_bytes"])
    cuda_check(rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize, limit), "cudaDeviceSetLimit")
    num_bytes = min(weight.numel() * weight.element_size(), info["max_window_bytes"])
    window = L2Window(weight.data_ptr(), num_bytes, min(1.0, limit / num_bytes), limit)
    value = rt.cudaStreamAttrValue()
    w = value.accessPolicyWindow
    w.base_ptr, w.num_bytes, w.hitRatio = window.base_ptr, window.num_bytes, window.hit_ratio
    w.hitProp = rt.cudaAccessProperty.cudaAccessPropertyPersisting
    w.missProp = rt.cudaAccessProperty.cudaAccessPropertyStreaming
    _set_stream_window(stream, value)
    return window


def clear_window(stream: torch.cuda.Stream) -> None:
    """Remove ``stream``'s window, return the persisting lines to normal and the set-aside to 0."""
    rt = _rt()
    value = rt.cudaStreamAttrValue()
    value.accessPolicyWindow.num_bytes = 0
    _set_stream_window(stream, value)
    cuda_check(rt.cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")
    cuda_check(rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize, 0), "cudaDeviceSetLimit")


def _set_stream_window(stream: torch.cuda.Stream, value) -> None:
    rt = _rt()
    cuda_check(rt.cudaStreamSetAttribute(stream.cuda_stream, rt.cudaStreamAttrID.cudaLaunchAttributeAccessPolicyWindow,
                                         value), "cudaStreamSetAttribute(accessPolicyWindow)")


def graph_windows(graph) -> list[int]:
    """num_bytes of the access-policy window of every kernel node of a captured ``cudaGraph_t``
    (0 where none): shows whether capture carried the stream's window into the nodes."""
    rt = _rt()
    nodes, count = cuda_check(rt.cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes")
    nodes, _ = cuda_check(rt.cudaGraphGetNodes(graph, count), "cudaGraphGetNodes")
    out = []
    for n in nodes:
        if cuda_check(rt.cudaGraphNodeGetType(n), "cudaGraphNodeGetType") == rt.cudaGraphNodeType.cudaGraphNodeTypeKernel:
            v = cuda_check(rt.cudaGraphKernelNodeGetAttribute(
                n, rt.cudaKernelNodeAttrID.cudaLaunchAttributeAccessPolicyWindow), "cudaGraphKernelNodeGetAttribute")
            out.append(int(v.accessPolicyWindow.num_bytes))
    return out
