"""A tiny Qwen3 engine built once with AOTI on CPU (in the background: tests/support/prebuilt.py):
load, parity with eager, manifest checks, the confidence head's output and verify modes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_trt.builder.build import _copy_calibration, apply_overrides
from dspark_trt.checkpoints.prepare import prepare_models
from dspark_trt.config import get_preset
from dspark_trt.config.source import ModelSource
from dspark_trt.engine.manifest import EngineError, check_engine
from dspark_trt.runtime import LLM, SamplingParams
from dspark_trt.runtime.cost_curve import CostCurve
from dspark_trt.runtime.engine import EngineNetworks
from dspark_trt.runtime.networks import EagerNetworks

from tests.support import prebuilt
from tests.support.aoti_build import build_cpu_engine

MODEL = "qwen3-tiny-dspark"
SHAPES = dict(max_batch_size=4, max_seq_len=96, page_size=8)
HEAD = ["draft.enable_confidence_head=true"]        # the draft gets a (random) confidence head
CPU = torch.device("cpu")


def build(out: Path) -> None:                   # in a background process (tests/support/prebuilt.py)
    build_cpu_engine(MODEL, out / MODEL, seed=0, overrides=HEAD, **SHAPES)


BUILD = prebuilt.job("qwen3-tiny-engine", build, fixture="engine", timeout=1200)


@pytest.fixture(scope="module")
def engine() -> Path:
    return BUILD.wait() / MODEL


@pytest.fixture(scope="module")
def eager() -> LLM:
    """The engine's modules, eager: the same seed and the same override (the head is created
    last, so every other weight is the head-less preset's)."""
    pair, target, draft = prepare_models(ModelSource(model=MODEL), torch.float32, "cpu", seed=0, fuse=True,
                                         pair=apply_overrides(get_preset(MODEL), HEAD))
    assert draft.confidence_head is not None
    return LLM(pair, target, draft, device="cpu", dtype=torch.float32, **SHAPES)


def test_engine_generation_equals_eager_greedy(engine, eager):
    llm = LLM.from_engine(engine, device="cpu")
    prompts = [[5, 17, 42, 99, 3], [7, 7, 300, 12]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    got = llm.generate(prompts, sp)
    want = eager.generate(prompts, sp)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert g.stats.accepted == w.stats.accepted     # same drafts accepted in every round


def test_engine_networks_equal_eager_networks(engine, eager):
    nets = EngineNetworks(engine, device="cpu")
    ref = EagerNetworks(eager.target, eager.draft, nets.num_pages, nets.page_size, "cpu", torch.float32)
    table = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7]])
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [9, 10, 11, 12, 13]])
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1], [0, 1, 2, 3, 4]])
    (l1, t1), (l2, t2) = nets.target(tokens, pos, table), ref.target(tokens, pos, table)
    assert (l1 - l2).abs().max() < 1e-4 and (t1 - t2).abs().max() < 1e-4          # fp32 tolerance
    nets.draft_context(t1, pos, table)
    ref.draft_context(t2, pos, table)
    for a, b in zip(nets.draft_cache, ref.draft_cache["k"] + ref.draft_cache["v"]):
        assert (a - b).abs().max() < 1e-4
    args = (torch.tensor([5, 8, -1]), torch.tensor([5, 3, -1]), table, torch.tensor([0.0, 0.7, 0.0]),
            torch.tensor([1, 2, 3]))
    (d1, z1), (d2, z2) = nets.draft_block(*args), ref.draft_block(*args)
    assert torch.equal(d1, d2)
    assert (z1 - z2).abs().max() < 1e-4
    assert d1[2].eq(-1).all() and z1[2].eq(0).all()     # inert row (anchor -1) stays inert
    assert nets.has_confidence
    (d3, z3, c1), (_, _, c2) = nets.draft_block_confidence(*args), ref.draft_block_confidence(*args)
    assert torch.equal(d3, d1) and (z3 - z1).abs().max() == 0      # same call, same outputs
    assert c1.shape == (3, nets.num_spec_tokens) and (c1[:2] - c2[:2]).abs().max() < 1e-4
    assert c1[2].eq(float("-inf")).all()                            # inert row: c = 0
    for w in range(1, nets.num_spec_tokens):                        # a window: the block's first w
        (dw, zw), (ew, yw) = nets.draft_block(*args, width=w), ref.draft_block(*args, width=w)
        assert torch.equal(dw, d1[:, :w]) and torch.equal(dw, ew) and (zw - yw).abs().max() < 1e-4
    with pytest.raises(ValueError, match="width 5 outside 1..4"):
        nets.draft_block(*args, width=5)


@pytest.mark.parametrize("mode", ["threshold", "scheduled"])
def test_engine_confidence_modes_are_greedy_lossless(engine, eager, mode):
    """An engine whose draft has a head runs the confidence modes: greedy output equals the fixed
    rounds' (= the target's); threshold rounds verify the head's prefixes, not always all N."""
    llm = LLM.from_engine(engine, device="cpu", verify_cost=CostCurve([1, 64], [1.0, 40.0], "test: steep"))
    prompts = [[5, 17, 42, 99, 3], [7, 7, 300, 12], [1, 2, 3]]
    fixed = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, verify_mode=mode,
                        confidence_threshold=0.5)
    want = [o.output_ids for o in eager.generate(prompts, fixed)]
    got = llm.generate(prompts, sp)
    assert [o.output_ids for o in got] == want
    proposed = [p for o in got for p in o.stats.proposed[:-1]]        # the last round may be cut
    assert min(proposed) < llm.networks.num_spec_tokens, proposed       # the head's prefixes / windows


def test_engine_without_head_refuses_confidence_rounds(engine_copy):
    _edit_manifest(engine_copy, lambda m: m["networks"]["draft_block"]["outputs"].remove("confidence_logits"))
    nets = EngineNetworks(engine_copy, device="cpu", verify_checksums=False)
    assert not nets.has_confidence
    with pytest.raises(EngineError, match="no confidence head"):
        nets.draft_block_confidence(torch.tensor([1]), torch.tensor([3]), torch.tensor([[0, 1]]),
                                    torch.zeros(1), torch.zeros(1, dtype=torch.long))


def test_build_copies_the_drafts_calibration_only_with_its_head(tmp_path):
    src, dst = tmp_path / "draft", tmp_path / "engine"
    src.mkdir(), dst.mkdir()
    (src / "confidence_calibration.json").write_text('{"temperatures": [1.5, 2.0]}')
    class Draft:
        confidence_head = None
    assert _copy_calibration(str(src), Draft(), dst) is None and not list(dst.iterdir())
    Draft.confidence_head = object()
    assert _copy_calibration(None, Draft(), dst) is None
    assert _copy_calibration(str(src), Draft(), dst) == "confidence_calibration.json"
    assert (dst / "confidence_calibration.json").read_text() == '{"temperatures": [1.5, 2.0]}'


def test_build_over_a_draft_vocabulary_copies_the_sets_calibration_under_the_engines_name(tmp_path):
    """The engine keeps the set's calibration as its own ``confidence_calibration.json`` (its set
    is compiled in), never the full vocabulary's, and records the set's size and key."""
    from types import SimpleNamespace
    from dspark_trt.builder.build import _draft_vocab_entry
    from dspark_trt.models.draft_vocab import DraftVocab
    src, dst = tmp_path / "draft", tmp_path / "engine"
    src.mkdir(), dst.mkdir()
    vocab = DraftVocab(torch.tensor([1, 4, 6]), torch.zeros(8, 2), torch.zeros(8, 2))
    draft = SimpleNamespace(confidence_head=object(), draft_vocab=vocab)
    (src / "confidence_calibration.json").write_text('{"temperatures": [1.5]}')
    said = []
    assert _copy_calibration(str(src), draft, dst, said.append) is None and not list(dst.iterdir())
    assert "made without this draft vocabulary" in said[0] and f"vocab-{vocab.key}" in said[0]
    (src / f"confidence_calibration.vocab-{vocab.key}.json").write_text('{"temperatures": [0.7]}')
    assert _copy_calibration(str(src), draft, dst) == "confidence_calibration.json"
    assert (dst / "confidence_calibration.json").read_text() == '{"temperatures": [0.7]}'
    assert _draft_vocab_entry(draft) == {"size": 3, "key": vocab.key} and vocab.key.startswith("3-")
    assert _draft_vocab_entry(SimpleNamespace()) is None
    assert DraftVocab(torch.tensor([1, 4, 7]), torch.zeros(8, 2), torch.zeros(8, 2)).key != vocab.key
    assert DraftVocab(torch.tensor([6, 1, 4]), torch.zeros(8, 2), torch.zeros(8, 2)).key == vocab.key  # a set


def test_manifest_records_build_and_stores_shared_weights_once(engine):
    m = json.loads((engine / "manifest.json").read_text())
    assert m["backend"] == "aoti" and m["device"] == {"type": "cpu"}
    assert m["versions"]["torch"] == torch.__version__
    assert set(m["networks"]) == {"target", "draft_context", "draft_block"}
    assert m["networks"]["draft_block"]["outputs"] == ["drafts", "draft_logits", "confidence_logits"]
    assert set(m["files"]) == {"target.pt2", "draft_context.pt2", "draft_block.pt2", "weights.safetensors"}
    # the draft networks borrow the target's embedding and lm_head: mapped to the same stored tensor
    block = m["networks"]["draft_block"]["constants"]
    assert block["draft.embed_tokens.weight"] == "target.model.embed_tokens.weight"
    assert block["draft.lm_head.weight"] == "target.lm_head.weight"
    from safetensors import safe_open
    with safe_open(str(engine / "weights.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored == {w for n in m["networks"].values() for w in n["constants"].values()}
    assert not any(k.startswith("draft.embed_tokens") or k.startswith("draft.lm_head") for k in stored)


def test_manifest_says_how_each_dspark_op_was_compiled(engine):
    """Every dspark op a network calls is listed, with why it is a reference (CPU: no Triton)."""
    nets = json.loads((engine / "manifest.json").read_text())["networks"]
    assert set(nets["target"]["ops"]) == {"dspark::kv_cache_write", "dspark::block_attention"}
    assert set(nets["draft_context"]["ops"]) == {"dspark::kv_cache_write"}
    assert set(nets["draft_block"]["ops"]) == {"dspark::kv_cache_write", "dspark::block_attention",
                                               "dspark::markov_sample"}
    for net in nets.values():
        assert set(net["ops"].values()) == {"pytorch reference: CPU build: inductor compiles no Triton "
                                            "kernels on CPU"}


@pytest.fixture
def engine_copy(engine, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(engine, dst)
    return dst


def _edit_manifest(path: Path, fn) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_corrupted_weights_are_refused(engine_copy):
    w = engine_copy / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"weights.safetensors' is corrupted.*rebuild it with: dspark-trt build"):
        check_engine(engine_copy, CPU)


def test_missing_network_is_refused(engine_copy):
    (engine_copy / "draft_block.pt2").unlink()
    with pytest.raises(EngineError, match="draft_block.pt2' listed in the manifest is missing"):
        LLM.from_engine(engine_copy, device="cpu")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format_version=99), "format version 99"),
    (lambda m: m["versions"].update(torch="2.0.0"), "built with torch 2.0.0"),
    (lambda m: m.update(device={"type": "cuda", "name": "NVIDIA H200", "capability": "9.0"}),
     "built for cuda, loading on cpu"),
])
def test_manifest_mismatch_is_refused(engine_copy, edit, message):
    _edit_manifest(engine_copy, edit)
    with pytest.raises(EngineError, match=message):
        check_engine(engine_copy, CPU)


def test_runtime_limits_above_the_build_are_refused(engine):
    with pytest.raises(EngineError, match="max_seq_len=4096 exceeds the 96"):
        EngineNetworks(engine, device="cpu", max_seq_len=4096)


def test_info_command_prints_and_checks_engine(engine, capsys):
    from dspark_trt.cli import main
    assert main(["info", str(engine)]) == 0
    out = capsys.readouterr().out
    assert '"format_version": 1' in out and "check: ok" in out
    assert "ops target: dspark::" in out and "= pytorch reference: CPU build" in out


def test_engine_cost_curve_times_its_context_write(engine):
    """``bench.cost_curve`` (what ``bench --cost-curve`` saves) on an engine: the draft's context
    write timed at 1 and at the prompt's 8 positions per row through the engine's ``draft_context``
    (dynamic token count, dense inputs), a curve that loads."""
    from dspark_trt.commands import bench
    llm = LLM.from_engine(engine, device="cpu")
    gen = llm.scheduler()
    seqs = [gen.add_request(list(range(3, 11)), SamplingParams(max_new_tokens=4, ignore_eos=True))
            for _ in range(2)]
    gen.step()                                                     # the prefill only: positions 0 .. 7
    pts = bench.cost_curve(llm, gen.round_inputs(seqs), [1, 2], 1)
    assert pts["context_tokens"] == [1, 2, 8, 16] and all(v >= 0 for v in pts["context_ms"])
    curve = CostCurve.from_points(pts, "engine")
    assert curve.context(16) == pts["context_ms"][-1]
