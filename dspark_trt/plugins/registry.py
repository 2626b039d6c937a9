"""The one registry of the ``dspark`` ops: every exporter reads it.

Each op module (``kv_cache.py``, ``block_attention.py``, ...) holds the op's schema (the
``torch.library`` registration), its PyTorch reference, the launch of its Triton kernel
(``kernels/``), and ``OPS``: one :class:`OpSpec` per torch op it registers, describing the op for
the exporters. ``OPS`` below collects them, one line per op module. From it come:

* ``builder/export.py``: the references inlined for export (``reference_impls``), the ops whose
  Triton kernel exports with dynamic shapes (``EXPORT_SAFE_KERNELS``) and why the others are
  compiled from their references (``REFERENCE_REASONS``);
* ``onnx_export.py``: the ONNX node types (``SPECS``), the torch op -> node map (``TORCH_OPS``),
  the evaluators' references; ``builder/onnx_network.py``: the functional twins of mutating ops;
* ``aot.py``: the AOT entry kernels' signatures (``AOT_KERNELS``); the entry kernel itself is
  ``aot.py:<name>_aot``;
* ``tensorrt_plugins.py``: which ops have a TensorRT plugin (``PLUGINS``); the descriptors
  (``@trtp.register`` / ``autotune`` / ``aot_impl``) are written there per op;
* ``__init__.py``: the ``torch.ops.dspark.<name>`` aliases.

Nothing here imports Triton, ONNX or TensorRT: descriptions are plain data.
"""
from __future__ import annotations

from typing import Callable

from .opspec import AotDesc, OnnxNode, OpSpec  # noqa: F401  (the registry's types)


def _collect(*modules) -> dict[str, OpSpec]:
    ops = {}
    for m in modules:
        for spec in m.OPS:
            if spec.name in ops:
                raise ValueError(f"dspark::{spec.name} registered twice")
            ops[spec.name] = spec
    for spec in ops.values():
        if spec.functional is not None and spec.functional not in ops:
            raise ValueError(f"{spec.name}: functional twin {spec.functional} is not registered")
    return ops


# ---- the registry: one line per op module ------------------------------------------------------
from . import block_attention, kv_cache, markov_sample, moe_experts  # noqa: E402
from . import noncausal_swa_indices, rejection_sample, sparse_mla_attention  # noqa: E402

OPS: dict[str, OpSpec] = _collect(
    kv_cache,
    block_attention,
    markov_sample,
    rejection_sample,
    noncausal_swa_indices,
    sparse_mla_attention,
    moe_experts,
)


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
