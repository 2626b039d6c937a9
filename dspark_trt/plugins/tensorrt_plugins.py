"""TensorRT plugin descriptors (``tensorrt.plugin``, "quickly deployable plugins") of the dspark ops.

Import this module before parsing an ONNX model with ``dspark`` nodes: each ``@trtp.register``
defines ``trtp.op.dspark.<name>`` (output shapes/dtypes), each ``@trtp.aot_impl`` hands TensorRT
the PTX of the op's AOT entry kernel (``aot.py``: same Triton kernel as the torch op), so the plan
runs without Python. Attributes are not serialized into AOT plans: they are baked into the PTX
(constexprs) or passed as ``SymInt32`` constants. Importing without TensorRT raises ImportError
(the guard); nothing else in the package imports this module.

Limitations: ``markov_sample`` uses the row-group schedule (one program per <= 16 rows runs all N
steps; a grid-wide split needs a zeroed workspace that AOT plugins do not get); the fast
``markov_sample_topk`` is two kernels and has no TensorRT plugin; ``moe_experts`` (and ``moe_experts_mxfp4``) runs the
per-token schedule (no workspace for the expert grouping, so each token reads its experts' w13
once per output tile: correct, not fast).
"""
from __future__ import annotations

import importlib

import tensorrt  # noqa: F401  (ImportError here is the guard)

from .registry import OPS

# the ops with a TensorRT plugin (registry flag ``tensorrt``); importing ``<op package>/tensorrt.py``
# registers its descriptors
PLUGINS = tuple(name for name, op in OPS.items() if op.tensorrt)
for _name in PLUGINS:
    importlib.import_module(f"{OPS[_name].package}.tensorrt")
