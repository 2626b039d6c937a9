"""The one registry of the ``dspark`` ops: every exporter reads it.

Each op lives in its own package ``plugins/<op>/``:

* ``__init__.py``: the op's schema (the ``torch.library`` registration), its PyTorch reference,
  the launch of its Triton kernel (``kernels/``) and ``OPS``: one :class:`OpSpec` per torch op it
  registers, describing the op for the exporters (ONNX node, AOT signature, export safety);
* ``aot.py``: the AOT entry kernel ``<name>_aot`` (TensorRT's argument order), if it has one;
* ``tensorrt.py``: the TensorRT plugin descriptors, if it has them.

``OPS`` below collects the specs, one line per op package. From it come:

* ``builder/export.py``: the references inlined for export (``reference_impls``), the ops whose
  Triton kernel exports with dynamic shapes (``EXPORT_SAFE_KERNELS``) and why the others are
  compiled from their references (``REFERENCE_REASONS``);
* ``onnx_export.py``: the ONNX node types (``SPECS``), the torch op -> node map (``TORCH_OPS``),
  the evaluators' references; ``builder/onnx_network.py``: the functional twins of mutating ops;
* ``aot.py``: the AOT entry kernels with their signatures (``AOT_KERNELS``);
* ``tensorrt_plugins.py``: the ops with a TensorRT plugin (``PLUGINS``), whose ``tensorrt.py`` it
  imports;
* ``__init__.py``: the ``torch.ops.dspark.<name>`` aliases.

Adding an op: a package ``plugins/<op>/`` (with its kernel) and one line in ``OPS``. Nothing here
imports Triton, ONNX or TensorRT: the specs are plain data.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from .opspec import AotDesc, OnnxNode, OpSpec  # noqa: F401  (the registry's types)


def _collect(*modules) -> dict[str, OpSpec]:
    ops = {}
    for m in modules:
        for spec in m.OPS:
            if spec.name in ops:
                raise ValueError(f"dspark::{spec.name} registered twice")
            ops[spec.name] = dataclasses.replace(spec, package=m.__name__)
    for spec in ops.values():
        if spec.functional is not None and spec.functional not in ops:
            raise ValueError(f"{spec.name}: functional twin {spec.functional} is not registered")
    return ops


# ---- the registry: one line per op package ------------------------------------------------------
PACKAGES = (
    "kv_cache",
    "block_attention",
    "markov_sample",
    "rejection_sample",
    "noncausal_swa_indices",
    "sparse_mla_attention",
    "moe_experts",
    "moe_experts_mxfp4",
    "fp8_linear",
)
OPS: dict[str, OpSpec] = _collect(*(importlib.import_module(f"{__package__}.{p}") for p in PACKAGES))


def onnx_nodes() -> dict[str, OpSpec]:
    """ONNX node type -> the op that defines it."""
    return {s.name: s for s in OPS.values() if s.onnx is not None}


def onnx_torch_ops() -> dict[str, str]:
    """Torch op exported to ONNX -> its node type (a mutating op exports through its twin)."""
    return {(s.functional or s.name): s.name for s in OPS.values() if s.onnx is not None}


def onnx_reference(node: str) -> Callable:
    """The functional reference that computes ONNX node ``node``'s outputs."""
    spec = OPS[node]
    return OPS[spec.functional].reference if spec.functional else spec.reference
