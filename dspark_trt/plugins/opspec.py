"""The description of one ``dspark`` op for the exporters (collected in ``registry.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class OnnxNode:
    """The ONNX node (domain ``dspark``, op_type = the op name = the TensorRT plugin name): ordered
    (name, type variable) inputs and outputs (type variables: ``onnx_export.TYPES``), and the op's
    scalar arguments as attributes (name -> "int" | "float"), in the op's argument order."""
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    attrs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AotDesc:
    """The AOT entry kernel ``<op package>/aot.py:<name>_aot`` (TensorRT's order: input pointers,
    int32 scalars, output pointers). Pointer dtypes are "T" (the op's float dtype) or a torch
    dtype; ``constants`` are the default compile-time constants (a dict, or a function returning
    one when a default lives in a kernel module that needs Triton to import)."""
    pointers: tuple
    ints: tuple[str, ...]
    outputs: tuple
    constants: dict | Callable[[], dict]
    num_warps: int = 4
    num_stages: int = 3                      # Triton's default; software-pipelined loads' buffers


@dataclass(frozen=True)
class OpSpec:
    """One ``dspark::<name>`` torch op as the exporters see it."""
    name: str
    reference: Callable                      # the plain PyTorch reference (``<name>_ref``)
    triton: str | None = None                # "kernels.<module>:<launcher>" run on CUDA tensors
    onnx: OnnxNode | None = None             # its ONNX node (None for a functional twin: it
                                             # exports as its mutating op's node)
    functional: str | None = None            # mutating op: its functional twin for ONNX, which
                                             # exports as this op's node (outputs = updated inputs)
    aot: AotDesc | None = None               # TensorRT AOT entry kernel (None: no AOT kernel)
    tensorrt: bool = False                   # has descriptors in <op package>/tensorrt.py
    export_safe: bool = False                # Triton kernel exports with dynamic shapes (AOTI, GPU)
    reference_reason: str | None = None      # why not export-safe (None: the generic reason)
    package: str = ""                        # the op's package (set by the registry): holds
                                             # aot.py (AOT entry kernel), tensorrt.py (descriptors)

    @property
    def qualname(self) -> str:
        return f"dspark::{self.name}"
