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

from .block_attention import block_attention_ref
from .kv_cache import kv_cache_update_ref
from .markov_sample import markov_sample_ref, markov_sample_topk_ref
from .moe_experts import moe_experts_ref
from .noncausal_swa_indices import noncausal_swa_indices_ref
from .rejection_sample import rejection_sample_ref
from .sparse_mla_attention import sparse_mla_attention_ref

DOMAIN = "dspark"
PLUGIN_VERSION = "1"
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_INTS = ["tensor(int64)", "tensor(int32)"]
TYPES = {"T": _FLOATS, "W": _FLOATS, "I": _INTS, "F": ["tensor(float)"], "L": ["tensor(int64)"],
         "I32": ["tensor(int32)"]}
INT, FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT


@dataclass(frozen=True)
class OpSpec:
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


SPECS = {s.name: s for s in [
    OpSpec("kv_cache_write",
           (("k_cache", "T"), ("v_cache", "T"), ("k", "T"), ("v", "T"), ("block_table", "I"),
            ("positions", "I")),
           (("k_cache_out", "T"), ("v_cache_out", "T"))),
    OpSpec("block_attention",
           (("q", "T"), ("k_cache", "T"), ("v_cache", "T"), ("block_table", "I"), ("positions", "I"),
            ("kv_limit", "I")),
           (("out", "T"),), {"scale": FLOAT}),
    OpSpec("markov_sample",
           (("base_logits", "T"), ("anchor", "L"), ("w1", "W"), ("w2", "W"), ("temperature", "F"),
            ("seed", "L"), ("start", "L")),
           (("tokens", "L"), ("z", "F"))),
    OpSpec("markov_sample_topk",
           (("base_logits", "T"), ("anchor", "L"), ("w1", "W"), ("w2", "W"), ("temperature", "F"),
            ("seed", "L"), ("start", "L")),
           (("tokens", "L"), ("z", "F")), {"chunk": INT, "per_chunk": INT}),
    OpSpec("rejection_sample",
           (("target_logits", "T"), ("draft_tokens", "L"), ("draft_logits", "F"), ("temperature", "F"),
            ("seed", "L"), ("start", "L")),
           (("accepted", "L"), ("next_token", "L"))),
    OpSpec("noncausal_swa_indices", (("start", "L"), ("block_table", "I")),
           (("indices", "I32"), ("lens", "I32")),
           {"num_queries": INT, "page_size": INT, "window": INT, "width": INT}),
    OpSpec("sparse_mla_attention",
           (("q", "T"), ("kv", "T"), ("indices", "I32"), ("attn_sink", "F")),
           (("out", "T"),), {"scale": FLOAT, "dv": INT}),
    OpSpec("moe_experts",
           (("x", "T"), ("expert_ids", "I"), ("routing_weights", "F"), ("w13", "T"), ("w2", "T")),
           (("out", "T"),), {"first_expert": INT, "swiglu_limit": FLOAT}),
]}

# torch op -> ONNX node type (the TensorRT plugin name)
TORCH_OPS = {
    "kv_cache_update": "kv_cache_write",
    "block_attention": "block_attention",
    "markov_sample": "markov_sample",
    "markov_sample_topk": "markov_sample_topk",
    "rejection_sample": "rejection_sample",
    "noncausal_swa_indices": "noncausal_swa_indices",
    "sparse_mla_attention": "sparse_mla_attention",
    "moe_experts": "moe_experts",
}


def _translation(spec: OpSpec):
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

_REFERENCES = {
    "kv_cache_write": kv_cache_update_ref,
    "block_attention": block_attention_ref,
    "markov_sample": markov_sample_ref,
    "markov_sample_topk": markov_sample_topk_ref,
    "rejection_sample": rejection_sample_ref,
    "noncausal_swa_indices": noncausal_swa_indices_ref,
    "sparse_mla_attention": sparse_mla_attention_ref,
    "moe_experts": moe_experts_ref,
}


def _evaluator(spec: OpSpec):
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
