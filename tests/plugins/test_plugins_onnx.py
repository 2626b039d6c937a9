"""Each dspark op exports to one ONNX node (domain dspark, op_type = TensorRT plugin name, plugin
attributes), passes onnx.checker, and evaluates on CPU (onnx.reference + our OpRun classes) to
exactly the PyTorch reference."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import dspark_trt.plugins  # noqa: F401  (registers the ops)
from dspark_trt.plugins.onnx_export import (SPECS, check_node, custom_translation_table,
                                            reference_evaluator_ops)

from tests.support.plugins_cases import (block_attention_inputs, kv_cache_inputs, markov_inputs, moe_inputs,
                                         moe_mxfp4_inputs, rejection_inputs, sparse_mla_inputs, swa_inputs)

ops = torch.ops.dspark


class Call(torch.nn.Module):
    """forward(*tensors) = op(*tensors, *scalars)."""

    def __init__(self, op, *scalars):
        super().__init__()
        self.op, self.scalars = op, scalars

    def forward(self, *tensors):
        return self.op(*tensors, *self.scalars)


def _cases():
    kc, vc, k, v, table, pos = kv_cache_inputs("cpu")
    q, kcb, vcb, tb, posb, causal, _, scale = block_attention_inputs("cpu")
    mk = markov_inputs("cpu")
    rj = rejection_inputs("cpu")
    start, table_s, n, page, window, width = swa_inputs("cpu")
    qs, kvs, idx, sink, sscale, dv = sparse_mla_inputs("cpu")
    *moe, first, limit = moe_inputs("cpu")
    *mx, mx_first, mx_limit = moe_mxfp4_inputs("cpu")
    return {
        "kv_cache_write": (Call(ops.kv_cache_update), (kc, vc, k, v, table, pos)),
        "block_attention": (Call(ops.block_attention, scale), (q, kcb, vcb, tb, posb, causal)),
        "markov_sample": (Call(ops.markov_sample), mk),
        "markov_sample_topk": (Call(ops.markov_sample_topk, 64, 2), mk),
        "rejection_sample": (Call(ops.rejection_sample), rj),
        "noncausal_swa_indices": (Call(ops.noncausal_swa_indices, n, page, window, width), (start, table_s)),
        "sparse_mla_attention": (Call(ops.sparse_mla_attention, sscale, dv), (qs, kvs, idx, sink)),
        "moe_experts": (Call(ops.moe_experts, first, limit), tuple(moe)),
        "moe_experts_mxfp4": (Call(ops.moe_experts_mxfp4, mx_first, mx_limit), tuple(mx)),
    }


CASES = _cases()


def test_every_plugin_has_a_case():
    assert set(CASES) == set(SPECS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_export_and_evaluate(name):
    module, inputs = CASES[name]
    prog = torch.onnx.export(module.eval(), tuple(inputs), dynamo=True,
                             custom_translation_table=custom_translation_table())
    model = prog.model_proto
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.domain == "dspark"]
    assert [n.op_type for n in nodes] == [name]
    check_node(nodes[0])
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"dspark" and attrs["plugin_version"] == b"1"
    assert ("dspark", 1) in {(o.domain, o.version) for o in model.opset_import}

    feeds = {i.name: x.numpy() for i, x in zip(model.graph.input, inputs)}
    got = ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)
    want = module(*[x.clone() for x in inputs])
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w.numpy())


def test_check_node_names_the_missing_attribute():
    node = onnx.helper.make_node("sparse_mla_attention", ["q", "kv", "i", "s"], ["o"], domain="dspark",
                                 name="attn0", scale=0.1, plugin_namespace="dspark", plugin_version="1")
    with pytest.raises(ValueError, match=r"attn0.*\['dv'\]"):
        check_node(node)
