"""ONNX export of the networks with the dspark ops as ``dspark``-domain nodes (TensorRT plugins).

ONNX has no in-place update, and the torch ONNX exporter drops mutations of graph inputs and
cannot translate ``auto_functionalized`` custom ops. So for ONNX every mutating dspark op (the KV
cache writes) is traced through a *functional twin* ``dspark_export::<op>`` that returns the
updated tensors; later dspark ops in the same network read the updated values, and the network
returns them as extra outputs ``present.<i>`` (i = index in the flat cache list). The ONNX node is
still ``dspark::<op>``, with one output per mutated input; a TensorRT plugin implements it in
place by aliasing each of those outputs to its input.

The node translations and the CPU evaluators come from ``dspark_trt.plugins.onnx_export``
(``custom_translation_table()``, ``reference_evaluator_ops()``). Until that module exists on this
branch, ``_fallback_*`` below provides generic ones built from the op schemas.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .export import ExportSpec, op_name, reference_impls

DOMAIN, OPSET = "dspark", 1
_TWINS: dict[str, object] = {}              # "dspark::op" -> functional twin OpOverload


def _tensor_arg(a) -> bool:
    return isinstance(a.type, torch.TensorType)


def _mutated(schema) -> list[int]:
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _schema(name: str):
    ns, op = name.split("::")
    return getattr(getattr(torch.ops, ns), op).default._schema


def functional_twin(name: str):
    """``dspark_export::<op>``: same arguments, returns clones of the mutated ones after the op."""
    if name in _TWINS:
        return _TWINS[name]
    schema = _schema(name)
    mutated = _mutated(schema)
    op = name.split("::")[1]
    args = ", ".join(f"{a.type} {a.name}" for a in schema.arguments)
    rets = ", ".join("Tensor" for _ in mutated)
    lib = torch.library.Library("dspark_export", "FRAGMENT")
    lib.define(f"{op}({args}) -> ({rets})")
    original = getattr(torch.ops.dspark, op).default

    def impl(*a):
        a = list(a)
        for i in mutated:
            a[i] = a[i].clone()
        original(*a)
        return tuple(a[i] for i in mutated)

    def fake(*a):
        return tuple(torch.empty_like(a[i]) for i in mutated)

    lib.impl(op, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dspark_export::{op}", fake, lib=lib)
    _TWINS[name] = (getattr(torch.ops.dspark_export, op).default, mutated, lib)
    return _TWINS[name]


class FunctionalCaches(TorchFunctionMode):
    """Routes mutating dspark ops to their functional twins and tracks the newest value of each
    mutated tensor (by the identity of the tensor the model passed)."""

    def __init__(self):
        super().__init__()
        self.latest: dict[int, Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if name is None:
            return func(*args, **(kwargs or {}))
        assert not kwargs, f"{name}: call dspark ops with positional arguments"
        new_args = [self.latest.get(id(a), a) if isinstance(a, Tensor) else a for a in args]
        if not _mutated(_schema(name)):
            return func(*new_args)
        twin, mutated, _ = functional_twin(name)
        for i, out in zip(mutated, twin(*new_args)):
            self.latest[id(args[i])] = out
        return None


class _Trace:
    updated: list[int] = []                   # flat cache indices the network returns


class OnnxNetwork(nn.Module):
    """A network whose updated caches are explicit outputs (``present.<i>``)."""

    def __init__(self, spec: ExportSpec):
        super().__init__()
        self.inner = spec.module
        self.trace = _Trace()     # export restores module attributes; a plain object survives

    def forward(self, *args):
        caches = args[-1]
        with FunctionalCaches() as mode:
            out = self.inner(*args)
        out = out if isinstance(out, tuple) else (out,)
        updated = [i for i, c in enumerate(caches) if id(c) in mode.latest]
        self.trace.updated = updated
        return (*out, *[mode.latest[id(caches[i])] for i in updated])


# ---- translations and evaluators ----------------------------------------------------------------

def translation_table() -> dict:
    """OpOverload -> onnxscript function emitting the ``dspark`` node, for every dspark op."""
    table = {}
    for name in reference_impls():
        schema = _schema(name)
        if _mutated(schema):
            twin, _, _ = functional_twin(name)
            table[twin] = _fallback_translation(name, schema, len(_mutated(schema)))
        else:
            table[getattr(torch.ops.dspark, name.split("::")[1]).default] = \
                _fallback_translation(name, schema, len(schema.returns))
    try:                                   # the plugins' own translations win where they exist
        from ..plugins.onnx_export import custom_translation_table
        table.update(custom_translation_table())
    except ImportError:
        pass
    return table


def evaluator_ops() -> list[type]:
    """onnx.reference OpRun classes for the dspark nodes (plugins' own first, fallback otherwise)."""
    ops = {cls.__name__: cls for cls in (_fallback_evaluator(n) for n in reference_impls())}
    try:
        from ..plugins.onnx_export import reference_evaluator_ops
        ops.update({cls.__name__: cls for cls in reference_evaluator_ops()})
    except ImportError:
        pass
    return list(ops.values())


_ONNX_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)",
               "tensor(int64)", "tensor(int32)", "tensor(bool)"]


def _attr_type(arg):
    from onnx.defs import OpSchema
    t = str(arg.type)
    return {"float": OpSchema.AttrType.FLOAT, "int": OpSchema.AttrType.INT,
            "bool": OpSchema.AttrType.INT, "str": OpSchema.AttrType.STRING}[t]


def _fallback_translation(name: str, schema, num_outputs: int):
    """FALLBACK (until plugins/onnx_export.py is merged): a generic dspark node from the schema;
    tensor arguments are inputs, scalars are attributes, plus plugin_namespace/plugin_version."""
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset
    op = name.split("::")[1]
    tensors = [a.name for a in schema.arguments if _tensor_arg(a)]
    scalars = [a for a in schema.arguments if not _tensor_arg(a)]
    onnx_schema = OpSchema(
        op, DOMAIN, OPSET,
        inputs=[OpSchema.FormalParameter(n, f"T{i}") for i, n in enumerate(tensors)],
        outputs=[OpSchema.FormalParameter(f"out{i}", f"O{i}") for i in range(num_outputs)],
        type_constraints=[(f"T{i}", _ONNX_TYPES, "") for i in range(len(tensors))]
        + [(f"O{i}", _ONNX_TYPES, "") for i in range(num_outputs)],
        attributes=[OpSchema.Attribute(a.name, _attr_type(a)) for a in scalars]
        + [OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING),
           OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING)])
    node = Op(Opset(DOMAIN, OPSET), op, onnx_schema)
    names = [a.name for a in schema.arguments]

    def translate(*args, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        attrs = {a.name: (int(bound[a.name]) if str(a.type) == "bool" else bound[a.name]) for a in scalars}
        return node(*[bound[n] for n in tensors], **attrs, plugin_namespace=DOMAIN, plugin_version="1")

    return translate


def _fallback_evaluator(name: str) -> type:
    """FALLBACK evaluator: runs the op's PyTorch reference on the node inputs (functional form)."""
    import numpy as np
    from onnx.reference.op_run import OpRun
    schema = _schema(name)
    mutated = _mutated(schema)
    ref = reference_impls()[name]
    order = [a for a in schema.arguments]

    def _run(self, *inputs, plugin_namespace=None, plugin_version=None, **attrs):
        it = iter(torch.from_numpy(np.array(x)) for x in inputs)
        args = [next(it) if _tensor_arg(a) else (bool(attrs[a.name]) if str(a.type) == "bool"
                                                  else attrs[a.name]) for a in order]
        out = ref(*args)
        if mutated:
            out = tuple(args[i] for i in mutated)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o.numpy() for o in out)

    return type(name.split("::")[1], (OpRun,), {"op_domain": DOMAIN, "_run": _run})


# ---- export ------------------------------------------------------------------------------------

def export_onnx(spec: ExportSpec, path=None):
    """-> (onnx.ModelProto, output names). Inputs: spec.input_names + cache.<i>; outputs:
    spec.output_names + present.<i> for every cache the network writes."""
    net = OnnxNetwork(spec)
    with torch.no_grad():
        ep = torch.export.export(net, spec.args, dynamic_shapes=((*spec.dynamic_shapes.values(),),),
                                 strict=False)
    n_cache = len(spec.args[-1])
    outputs = spec.output_names + [f"present.{i}" for i in net.trace.updated]
    prog = torch.onnx.export(ep, spec.args, dynamo=True, custom_translation_table=translation_table(),
                             input_names=spec.input_names + [f"cache.{i}" for i in range(n_cache)],
                             output_names=outputs, optimize=True, verbose=False)
    if path is not None:
        prog.save(str(path), external_data=False)
    return prog.model_proto, outputs
