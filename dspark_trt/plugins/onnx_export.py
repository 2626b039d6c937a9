"""ONNX symbolics of the ``dspark`` ops and a CPU evaluator for the resulting nodes.

Every op exports as one node of domain ``dspark`` whose ``op_type`` is the TensorRT plugin name,
with the op's scalar arguments as attributes plus ``plugin_namespace="dspark"`` and
``plugin_version="1"`` (what TensorRT's ONNX parser needs to find the plugin registered in
``tensorrt_plugins.py``). Use::

    torch.onnx.export(model, args, dynamo=True, custom_translation_table=custom_translation_table())
    onnx.reference.ReferenceEvaluator(model_proto, new_ops=reference_evaluator_ops())

``kv_cache_write`` mutates its caches, which ONNX cannot express: export a graph that calls the
functional twin ``dspark::kv_cache_update`` instead; it becomes the node ``kv_cache_write`` whose
two outputs are the updated caches (the TensorRT plugin aliases them to the cache inputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx.defs import OpSchema

from .registry import onnx_nodes, onnx_reference, onnx_torch_ops

DOMAIN = "dspark"
PLUGIN_VERSION = "1"
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_INTS = ["tensor(int64)", "tensor(int32)"]
TYPES = {"T": _FLOATS, "W": _FLOATS, "I": _INTS, "F": ["tensor(float)"], "L": ["tensor(int64)"],
         "I32": ["tensor(int32)"], "U8": ["tensor(uint8)"]}
INT, FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT


_ATTR_TYPES = {"int": INT, "float": FLOAT}


@dataclass(frozen=True)
class NodeSpec:
    """One ONNX node type: ordered (name, type variable) inputs and outputs, op attributes."""
    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    attrs: dict = field(default_factory=dict)       # attribute name -> OpSchema.AttrType

    def schema(self) -> OpSchema:
        used = {t for _, t in self.inputs + self.outputs}
        attrs = [OpSchema.Attribute(a, t, "") for a, t in self.attrs.items()]
        attrs += [OpSchema.Attribute(a, OpSchema.AttrType.STRING, "")
                  for a in ("plugin_namespace", "plugin_version")]
        return OpSchema(self.name, DOMAIN, 1,
                        inputs=[OpSchema.FormalParameter(n, t) for n, t in self.inputs],
                        outputs=[OpSchema.FormalParameter(n, t) for n, t in self.outputs],
                        type_constraints=[(t, TYPES[t], "") for t in sorted(used)],
                        attributes=attrs)


# ONNX node type (the TensorRT plugin name) -> its description, from the op registry
SPECS = {name: NodeSpec(name, op.onnx.inputs, op.onnx.outputs,
                        {a: _ATTR_TYPES[t] for a, t in op.onnx.attrs.items()})
         for name, op in onnx_nodes().items()}

# torch op -> ONNX node type (a mutating op exports through its functional twin)
TORCH_OPS = onnx_torch_ops()


def _translation(spec: NodeSpec):
    from onnxscript.values import Op, Opset
    op = Op(Opset(DOMAIN, 1), spec.name, spec.schema())
    n_in = len(spec.inputs)

    def translate(*args):
        attrs = dict(zip(spec.attrs, args[n_in:]))
        attrs = {k: float(v) if spec.attrs[k] == FLOAT else int(v) for k, v in attrs.items()}
        return op(*args[:n_in], **attrs, plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION,
                  _num_outputs=len(spec.outputs))
    translate.__name__ = f"dspark_{spec.name}"
    return translate


def custom_translation_table() -> dict:
    """``{torch.ops.dspark.<op>.default: onnxscript function}`` for ``torch.onnx.export(dynamo=True)``."""
    return {getattr(torch.ops.dspark, t).default: _translation(SPECS[o]) for t, o in TORCH_OPS.items()}


# ---------------------------------------------------------------------------------------------
# CPU evaluation of exported models (onnx.reference), through the PyTorch references.

_REFERENCES = {name: onnx_reference(name) for name in SPECS}


def _evaluator(spec: NodeSpec):
    from onnx.reference.op_run import OpRun
    ref = _REFERENCES[spec.name]

    def _run(self, *inputs, **attrs):
        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        scalars = [attrs[a] for a in spec.attrs]
        out = ref(*tensors, *scalars)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o.numpy() for o in out)

    return type(spec.name, (OpRun,), {"op_domain": DOMAIN, "_run": _run})


def reference_evaluator_ops() -> list:
    """``onnx.reference.op_run.OpRun`` subclasses (class name == op_type, domain dspark)."""
    return [_evaluator(s) for s in SPECS.values()]


def check_node(node: onnx.NodeProto) -> None:
    """Raise if a ``dspark`` node lacks what the TensorRT plugin lookup needs."""
    spec = SPECS.get(node.op_type)
    if node.domain != DOMAIN or spec is None:
        raise ValueError(f"node {node.name!r}: not a dspark plugin node ({node.domain}::{node.op_type})")
    names = {a.name for a in node.attribute}
    missing = ({"plugin_namespace", "plugin_version"} | set(spec.attrs)) - names
    if missing:
        raise ValueError(f"node {node.name!r} ({node.op_type}) lacks attributes {sorted(missing)}")
