"""Builder pieces that need no full compile: atomic writes, overrides, backends, ONNX export."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark_trt.builder import build as build_mod
from dspark_trt.builder.backends import BuildError, pick_backend, tensorrt_available
from dspark_trt.builder.build import BuildOptions, apply_overrides, build_engine
from dspark_trt.engine.manifest import config_from_json, config_to_json, write_manifest
from dspark_trt.builder.output_dir import atomic_engine_dir
from dspark_trt.builder.export import BuildShapes, network_specs
from dspark_trt.config import PRESETS, ConfigError, get_preset
from dspark_trt.models import build_models

from tests.support import prebuilt
from tests.support.aoti_build import build_cpu_engine

TINY = "qwen3-tiny-dspark"


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_atomic_dir_failure_keeps_previous_engine(tmp_path):
    out = tmp_path / "eng"
    with atomic_engine_dir(out) as d:
        (d / "a").write_text("old")
        write_manifest(d, {"backend": "aoti"})        # an engine of ours: it may be replaced
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_engine_dir(out) as d:
            (d / "a").write_text("new, half written")
            raise RuntimeError("boom")
    assert (out / "a").read_text() == "old"
    assert _leftovers(tmp_path) == ["eng"]


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    from dspark_trt.builder.backends import aoti

    def fail_on_second(ep, path, cxx, calls=[]):
        path.write_bytes(b"partial package")
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt("interrupted mid-write")
    monkeypatch.setattr(aoti, "compile_network", fail_on_second)
    # no real export (the engine tests cover it): weightless programs reach the compile stage at once
    monkeypatch.setattr(build_mod, "export_network",
                        lambda spec, inline: (SimpleNamespace(state_dict={}, constants={}), {}))
    out = tmp_path / "engines" / TINY
    with pytest.raises(KeyboardInterrupt):
        build_engine(BuildOptions(model=TINY, output=str(out), random_weights=True, device="cpu",
                                  backend="aoti", max_seq_len=64, page_size=8, check_toolchain=False),
                     report=lambda m: None)
    assert not out.exists()
    assert _leftovers(out.parent) == []


def test_build_options_errors_name_the_problem():
    with pytest.raises(ConfigError, match="--random-weights"):
        BuildOptions(model=TINY).resolved()
    with pytest.raises(ConfigError, match="--checkpoint and --draft-checkpoint go together"):
        BuildOptions(model=TINY, checkpoint="x").resolved()
    with pytest.raises(ConfigError, match="--max-seq-len must be positive"):
        BuildOptions(model=TINY, random_weights=True, max_seq_len=0).resolved()


def test_override_cuts_target_layers_and_keeps_draft_dims():
    base = get_preset("qwen3-8b-dspark-block7")
    pair = apply_overrides(base, ["num_hidden_layers=8"])
    assert pair.target.num_hidden_layers == 8 and pair.draft.num_target_layers == 8
    ids = pair.draft.target_layer_ids
    assert len(ids) == len(base.draft.target_layer_ids) and ids[-1] < 7 and ids == sorted(set(ids))
    assert pair.draft.backbone.hidden_size == base.draft.backbone.hidden_size
    assert pair.draft.num_hidden_layers == base.draft.num_hidden_layers
    pair = apply_overrides(base, ["num_hidden_layers=8", "draft.target_layer_ids=[0,1,2,3,4]"])
    assert pair.draft.target_layer_ids == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="has no field 'num_layerz'"):
        apply_overrides(base, ["num_layerz=3"])
    with pytest.raises(ConfigError, match="needs at least 6 layers"):
        apply_overrides(base, ["num_hidden_layers=3"])


def test_config_roundtrip_through_manifest_json():
    pair = get_preset(TINY)
    for cfg in (pair.target, pair.draft):
        assert config_from_json(config_to_json(cfg)) == cfg


def test_auto_backend_says_why():
    ok, why = tensorrt_available()
    backend, reason = pick_backend("auto")
    assert backend == ("tensorrt" if ok else "aoti") and why in reason
    if not ok:
        with pytest.raises(BuildError, match="--backend tensorrt: .*use --backend aoti"):
            pick_backend("tensorrt")


def _tiny_specs(draft_ids: torch.Tensor | None = None):
    """The tiny preset's three networks; ``draft_ids``: the draft over those tokens (``--draft-vocab``)."""
    pair = get_preset(TINY)
    target, draft = build_models(pair, torch.float32, "cpu", seed=0)
    if draft_ids is not None:
        from dspark_trt.models.draft_vocab import restrict_draft_vocab_
        restrict_draft_vocab_(draft, draft_ids)
    return network_specs(target, draft, BuildShapes(4, 64, draft.config.block_size, 8), torch.float32, "cpu")


def test_tensorrt_profiles_cover_the_build_ranges():
    from dspark_trt.builder.backends.tensorrt import profile_shapes
    shapes = BuildShapes(4, 64, 4, 8)
    specs = {s.name: s for s in _tiny_specs()}
    prof = profile_shapes(specs["target"], shapes)
    assert prof["tokens"] == ((1, 1), (4, 5), (4, 64))            # (min, opt, max): B, T
    assert prof["block_table"][2] == (4, shapes.max_pages_per_seq)
    lo, opt, hi = prof["cache.0"]
    assert lo[0] == 2 and hi[0] == shapes.num_pages() + 1 and lo[1:] == hi[1:]   # + pad page
    assert profile_shapes(specs["draft_block"], shapes)["temperature"] == ((1,), (4,), (4,))


def test_onnx_networks_match_eager_with_dspark_nodes():
    """Each network exported to ONNX with dspark-domain nodes, run by onnx.reference with the dspark
    evaluators, equals the eager module (fp32: |diff| <= 1e-5; tokens exact)."""
    for spec in _tiny_specs():
        _onnx_matches_eager(spec)


def test_onnx_draft_block_with_a_draft_vocabulary_matches_eager():
    """The draft over 64 of 512 tokens: its head, tables and the scatter of z to the full vocabulary
    export to ONNX (the TensorRT backend's route) and give the eager drafts and logits."""
    spec = next(s for s in _tiny_specs(torch.arange(0, 512, 8)) if s.name == "draft_block")
    _onnx_matches_eager(spec)


def _onnx_matches_eager(spec) -> None:
    """``spec`` exported to ONNX, run by onnx.reference with the dspark evaluators, equals eager."""
    from onnx.reference import ReferenceEvaluator
    from dspark_trt.builder.onnx_network import evaluator_ops, export_onnx
    model, outputs = export_onnx(spec)
    nodes = {n.op_type for n in model.graph.node if n.domain == "dspark"}
    assert "kv_cache_write" in nodes
    feeds = dict(zip(spec.input_names, spec.args[:-1]))
    feeds.update({f"cache.{i}": c for i, c in enumerate(spec.args[-1])})
    got = ReferenceEvaluator(model, new_ops=evaluator_ops()).run(
        None, {k: v.numpy() for k, v in feeds.items()})
    caches = [c.clone() for c in spec.args[-1]]
    want = spec.module(*spec.args[:-1], caches)
    want = list(want if isinstance(want, tuple) else ())
    want += [caches[int(n.split(".")[1])] for n in outputs if n.startswith("present.")]
    assert len(got) == len(want) == len(outputs)
    for name, g, w in zip(outputs, got, want):
        if w.dtype == torch.int64:
            assert np.array_equal(g, w.numpy()), name
        else:                                       # -inf (outside a draft vocabulary) where eager has it
            w = w.numpy()
            assert np.array_equal(np.isneginf(g), np.isneginf(w)), name
            assert np.abs(np.where(np.isneginf(w), 0, g - w)).max() <= 1e-5, name
    if spec.name == "draft_block":
        assert "markov_sample" in nodes


@pytest.mark.tensorrt
@pytest.mark.skipif(not tensorrt_available()[0] or not torch.cuda.is_available(),
                    reason="TensorRT plans need the tensorrt package and a GPU: " + tensorrt_available()[1])
def test_tensorrt_engine_generation_equals_eager(tmp_path):
    from dspark_trt.runtime import LLM, SamplingParams
    shapes = dict(max_batch_size=2, max_seq_len=64, page_size=8)
    out = tmp_path / TINY
    build_engine(BuildOptions(model=TINY, output=str(out), random_weights=True, dtype="fp32",
                              backend="tensorrt", device="cuda", **shapes))
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = LLM.from_engine(out, device="cuda").generate([1, 2, 3], sp)[0].output_ids
    want = LLM.from_preset(TINY, dtype=torch.float32, device="cuda", **shapes).generate([1, 2, 3], sp)[0].output_ids
    assert got == want


V4 = "deepseek-v4-tiny-dspark"
# The tiny V4 target has 5 layers: (attention, MoE routing) = (SWA-only, hash), (CSA ratio 4 +
# indexer, hash), (HCA ratio 16, score), (CSA, score), (HCA, score). Its first 3 layers keep every
# attention kind and both routings (a layer's attention and its MoE are separate modules), the 3
# draft taps (now 0, 1, 2: the last tap on the last layer, as V4 allows) and the draft unchanged;
# the AOTI build compiles 3 target layers instead of 5.
V4_CUT = ["draft.target_layer_ids=[0,1,2]", "num_hidden_layers=3"]
V4_SHAPES = dict(max_batch_size=2, max_seq_len=64, page_size=8)


def build_v4(out: Path) -> None:                # in a background process (tests/support/prebuilt.py)
    build_cpu_engine(V4, out / V4, overrides=V4_CUT, **V4_SHAPES)


V4_BUILD = prebuilt.job("v4-tiny-engine", build_v4, fixture="v4_engine", timeout=1800)


@pytest.fixture(scope="module")
def v4_engine() -> Path:
    return V4_BUILD.wait() / V4


def test_v4_cut_keeps_every_layer_kind():
    full, cut = get_preset(V4).target, apply_overrides(get_preset(V4), V4_CUT)
    kinds = lambda t: {(t.layer_ratio(i), i < t.num_hash_layers) for i in range(t.num_hidden_layers)}
    assert cut.target.num_hidden_layers == 3 and cut.draft.target_layer_ids == [0, 1, 2]
    assert {r for r, _ in kinds(cut.target)} == {r for r, _ in kinds(full)} == {0, 4, 16}
    assert {h for _, h in kinds(cut.target)} == {True, False}
    assert cut.draft.num_stages == get_preset(V4).draft.num_stages
    assert [cut.draft.stage_ratio(s) for s in range(cut.draft.num_stages)] == [0] * cut.draft.num_stages


@pytest.mark.slow
@pytest.mark.skipif(V4 not in PRESETS, reason=f"preset '{V4}' not defined yet (DeepSeek-V4 models not merged)")
def test_v4_tiny_engine_generation_equals_eager(v4_engine, monkeypatch):
    """Greedy generation from the AOTI engine (V4_CUT) equals eager, token for token and round for
    round; 30 new tokens cross the window (16) and the first HCA entry (ratio 16)."""
    from dspark_trt.runtime import LLM, SamplingParams
    cut = apply_overrides(get_preset(V4), V4_CUT)
    monkeypatch.setitem(PRESETS, V4, lambda: dataclasses.replace(cut))     # eager: the same cut
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    got = LLM.from_engine(v4_engine, device="cpu").generate(prompts, sp)
    want = LLM.from_preset(V4, seed=0, dtype=torch.float32, device="cpu", **V4_SHAPES).generate(prompts, sp)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert g.stats.accepted == w.stats.accepted


def test_memory_estimate_counts_shared_parameters_once():
    from dspark_trt.commands.info import memory_estimate
    est = memory_estimate(TINY, torch.bfloat16, 2, 100)
    target, draft = build_models(get_preset(TINY), torch.float32, "cpu", seed=0)
    unique = {id(p): p.numel() for m in (target, draft) for p in m.parameters()}
    assert sum(est["parameters"].values()) == sum(unique.values())
    assert est["weight_bytes"] == 2 * sum(unique.values())                  # bf16
    c = get_preset(TINY).target
    assert est["kv_bytes_per_token"]["target"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    assert memory_estimate("qwen3-8b-dspark-block7", torch.bfloat16, 8, 2048)["h200_count"] == 1


def test_info_model_shows_the_architecture():
    from dspark_trt.commands.info import memory_estimate
    arch = memory_estimate("qwen3-8b-dspark-block7", torch.bfloat16, 1, 128)["architecture"]
    t, d = arch["target"], arch["draft"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["vocab_size"]) == (4096, 36, 32, 8, 128, 151936)
    assert d["block_size"] == 7 and d["num_hidden_layers"] == 5 and len(d["target_layer_ids"]) == 5
    v4 = memory_estimate("deepseek-v4-tiny-dspark", torch.bfloat16, 1, 128)["architecture"]
    assert v4["target"]["n_routed_experts"] > 0 and "num_stages" in v4["draft"]


def test_kernel_build_failure_is_an_error_unless_references_are_allowed(tmp_path, monkeypatch):
    """No silent fallback: a network that fails to build with a Triton kernel compiled in stops the
    build (the real error, with a note naming --allow-reference-ops); with the flag, every op is
    compiled from its reference and the manifest says why."""
    from dspark_trt.builder.backends import aoti
    every = set(build_mod.reference_impls())
    monkeypatch.setattr(build_mod, "ops_to_inline", lambda device: every - {"dspark::block_attention"})

    def export(spec, inline):                 # as on a GPU whose kernel launcher cannot be exported
        if inline != every:
            raise RuntimeError("kernel launcher specialised a dynamic dim")
        return SimpleNamespace(state_dict={}, constants={}), {"dspark::block_attention": "reference"}
    monkeypatch.setattr(build_mod, "export_network", export)
    monkeypatch.setattr(aoti, "compile_network", lambda ep, path, cxx: path.write_bytes(b"package"))
    monkeypatch.setattr(aoti, "load_network", lambda *a, **k: None)
    opts = dict(model=TINY, random_weights=True, device="cpu", backend="aoti", max_seq_len=64, page_size=8,
                check_toolchain=False)
    with pytest.raises(RuntimeError, match="specialised") as err:
        build_engine(BuildOptions(output=str(tmp_path / "strict"), **opts), report=lambda m: None)
    assert any("--allow-reference-ops" in note for note in err.value.__notes__)
    assert not (tmp_path / "strict").exists()
    said = []
    m = build_engine(BuildOptions(output=str(tmp_path / "refs"), allow_reference_ops=True, **opts),
                     report=said.append)
    how = m["networks"]["target"]["ops"]["dspark::block_attention"]
    assert how.startswith("pytorch reference: --allow-reference-ops") and "specialised" in how
    assert any("WARNING" in line for line in said) and "--allow-reference-ops" in m["build_command"]
