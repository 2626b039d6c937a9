"""ONNX export of the networks with the dspark ops as ``dspark``-domain nodes (TensorRT plugins).

ONNX has no in-place update, and the torch ONNX exporter drops mutations of graph inputs and
cannot translate ``auto_functionalized`` custom ops. So for ONNX every mutating dspark op (the KV
cache writes) is traced through its *functional twin* named in the plugins' registry
(``OpSpec.functional``: ``dspark::kv_cache_update`` for ``dspark::kv_cache_write``), which returns
the updated tensors; later dspark ops in the same network read the updated values, and the
network returns them as extra outputs ``present.<i>`` (i = index in the flat cache list). The ONNX
node is still ``dspark::<op>``, with one output per mutated input; a TensorRT plugin implements it
in place by aliasing each of those outputs to its input.

The node translations and the CPU evaluators are the plugins' (``dspark_trt.plugins.onnx_export``:
``custom_translation_table()``, ``reference_evaluator_ops()``), built from the same registry.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..plugins.registry import OPS
from .export import ExportSpec, op_name


def _mutated(schema) -> list[int]:
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def functional_twin(name: str):
    """``dspark::<op>`` that mutates its inputs -> (its functional twin from the registry: same
    arguments, returns the updated copies of the mutated ones, in order; the mutated indices)."""
    op = name.split("::")[1]
    mutated = _mutated(getattr(torch.ops.dspark, op).default._schema)
    if not mutated:
        return None
    twin = OPS[op].functional if op in OPS else None
    if twin is None:
        raise NotImplementedError(f"{name} mutates its inputs and has no functional twin for ONNX "
                                  f"export (OpSpec.functional in dspark_trt/plugins)")
    return getattr(torch.ops.dspark, twin).default, mutated


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
        twin = functional_twin(name)
        if twin is None:
            return func(*new_args)
        twin, mutated = twin
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
    """OpOverload -> onnxscript function emitting the ``dspark`` node, for every dspark op that
    exports (a mutating op through its functional twin)."""
    from ..plugins.onnx_export import custom_translation_table
    return custom_translation_table()


def evaluator_ops() -> list[type]:
    """onnx.reference OpRun classes for the dspark nodes."""
    from ..plugins.onnx_export import reference_evaluator_ops
    return reference_evaluator_ops()


# ---- export ------------------------------------------------------------------------------------

def _name_twin_nodes(graph) -> None:
    """Name the node of a functional twin after the op it stands for (``node_kv_cache_write__1``,
    not ``node_kv_cache_update__1``): the node is that op's (its op_type says so)."""
    for name, op in OPS.items():
        if op.functional is None:
            continue
        for node in graph:
            if node.domain == "dspark" and node.op_type == name and node.name.startswith(f"node_{op.functional}"):
                node.name = f"node_{name}" + node.name[len(f"node_{op.functional}"):]


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
    _name_twin_nodes(prog.model.graph)
    if path is not None:
        prog.save(str(path), external_data=False)
    return prog.model_proto, outputs
