"""Exported networks (V4 and Qwen3) carry no lifted tensor constants: every tensor they read is a parameter or
buffer that moves with the module. A plain host tensor (the old float64 RoPE frequencies) becomes
a host constant inside a CUDA engine; AOTInductor then copies it to the device under a name no
weight provides (``_tensor_constant0``), and the engine cannot load."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.builder.build import BuildOptions, load_models
from dspark_trt.builder.export import BuildShapes, export_network, network_specs, reference_impls


@pytest.mark.parametrize("model", ["deepseek-v4-tiny-dspark", "qwen3-tiny-dspark"])
def test_networks_export_without_tensor_constants(model):
    o = BuildOptions(model=model, random_weights=True, dtype="fp32", device="cpu",
                     output="unused").resolved()
    _, target, draft = load_models(o, torch.float32, torch.device("cpu"))
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, draft.config.block_size, o.page_size)
    for spec in network_specs(target, draft, shapes, torch.float32, torch.device("cpu")):
        ep, _ = export_network(spec, set(reference_impls()))
        assert not ep.constants, f"{spec.name}: lifted tensor constants {sorted(ep.constants)[:3]}"


def _exported_target(model: str, overrides=(), quantization="fp8"):
    """A ``--quantization fp8`` build's target: (module, export spec, exported program, op table)."""
    o = BuildOptions(model=model, random_weights=True, dtype="fp32", device="cpu", overrides=list(overrides),
                     quantization=quantization, output="unused").resolved()
    _, target, draft = load_models(o, torch.float32, torch.device("cpu"))
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, draft.config.block_size, o.page_size)
    spec = next(s for s in network_specs(target, draft, shapes, torch.float32, torch.device("cpu"))
                if s.name == "target")
    ep, ops = export_network(spec, set())
    return target, spec, ep, ops


def _runs_like_eager(spec, ep) -> None:
    with torch.no_grad():
        want = spec.module(*spec.args)
        got = ep.module()(*spec.args)
    for a, b in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
def test_fp8_target_exports_with_its_weights_in_fp8_and_runs_like_eager(quantization):
    """An fp8 build (``--quantization fp8``): the exported target keeps its projections as
    float8_e4m3fn parameters read by ``dspark::fp8_linear`` (not dequantised into bf16 / fp32
    copies, which would double the engine's weights), and the exported program gives the eager
    module's outputs bit for bit. ``fp8-w8a8``: every call quantises its activations too."""
    target, spec, ep, ops = _exported_target("qwen3-tiny-dspark", quantization=quantization)
    assert ops.get("dspark::fp8_linear") == "kernel", ops
    fp8 = [n for n, t in ep.state_dict.items() if t.dtype == torch.float8_e4m3fn]
    n_proj = 7 * target.config.num_hidden_layers          # q k v o gate up down, fused or not
    assert fp8 and sum(ep.state_dict[n].numel() for n in fp8) == sum(
        p.numel() for n, p in target.named_parameters() if p.dtype == torch.float8_e4m3fn) > 0
    assert len(fp8) <= n_proj
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "fp8_linear" in str(n.target)]
    assert len(calls) == len(fp8)
    assert all(bool((list(n.args) + [0, False])[4]) == (quantization == "fp8-w8a8") for n in calls), \
        [n.args[3:] for n in calls]
    _runs_like_eager(spec, ep)


def test_v4_fp8_target_exports_its_routed_experts_in_mxfp4():
    """DeepSeek-V4 under ``--quantization fp8``: each MoE layer exports as one
    ``dspark::moe_experts_mxfp4`` node over the stacked uint8 packed / E8M0 buffers (no wide copy
    of the experts), and the program gives the eager module's outputs bit for bit. Four layers:
    two hash-routed, two score-routed (the export's cost grows with the layers)."""
    target, spec, ep, ops = _exported_target("deepseek-v4-tiny-dspark", ["num_hidden_layers=4"])
    assert ops.get("dspark::moe_experts_mxfp4") == "kernel", ops
    layers = target.config.num_hidden_layers
    packed = {n: t for n, t in ep.state_dict.items() if n.endswith(("w13_packed", "w13_scale", "w2_packed", "w2_scale"))}
    assert len(packed) == 4 * layers and all(t.dtype == torch.uint8 for t in packed.values())
    assert not any(n.endswith((".w13", ".w2")) for n in ep.state_dict)
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "moe_experts" in str(n.target)]
    assert len(calls) == layers and all("moe_experts_mxfp4" in str(n.target) for n in calls)
    _runs_like_eager(spec, ep)


def test_draft_block_with_a_draft_vocabulary_exports_and_runs_like_eager(tmp_path):
    """``build --draft-vocab``: the draft_block network holds the set's head and tables as buffers
    (no lifted constants) and the exported program gives the eager drafts and logits."""
    from dspark_trt.commands.draft_vocab import write_draft_vocab
    path = tmp_path / "v.json"
    write_draft_vocab(path, torch.arange(0, 512, 8), 512, {})
    o = BuildOptions(model="qwen3-tiny-dspark", random_weights=True, dtype="fp32", device="cpu",
                     draft_vocab=str(path), output="unused").resolved()
    _, target, draft = load_models(o, torch.float32, torch.device("cpu"))
    assert draft.lm_head.weight.shape[0] == 64 and target.lm_head.weight.shape[0] == 512
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, draft.config.block_size, o.page_size)
    spec = next(s for s in network_specs(target, draft, shapes, torch.float32, torch.device("cpu"))
                if s.name == "draft_block")
    ep, _ = export_network(spec, set(reference_impls()))
    assert not ep.constants and "draft.draft_vocab.token_ids" in ep.state_dict
    _runs_like_eager(spec, ep)
