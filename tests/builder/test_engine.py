"""A tiny Qwen3 engine built once with AOTI on CPU (in the background: tests/support/prebuilt.py):
load, parity with eager, manifest checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_trt.engine.manifest import EngineError, check_engine
from dspark_trt.runtime import LLM, SamplingParams
from dspark_trt.runtime.engine import EngineNetworks
from dspark_trt.runtime.networks import EagerNetworks

from tests.support import prebuilt
from tests.support.aoti_build import build_cpu_engine

MODEL = "qwen3-tiny-dspark"
SHAPES = dict(max_batch_size=4, max_seq_len=96, page_size=8)
CPU = torch.device("cpu")


def build(out: Path) -> None:                   # in a background process (tests/support/prebuilt.py)
    build_cpu_engine(MODEL, out / MODEL, seed=0, **SHAPES)


BUILD = prebuilt.job("qwen3-tiny-engine", build, fixture="engine", timeout=1200)


@pytest.fixture(scope="module")
def engine() -> Path:
    return BUILD.wait() / MODEL


@pytest.fixture(scope="module")
def eager() -> LLM:
    return LLM.from_preset(MODEL, seed=0, dtype=torch.float32, device="cpu", **SHAPES)


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


def test_manifest_records_build_and_stores_shared_weights_once(engine):
    m = json.loads((engine / "manifest.json").read_text())
    assert m["backend"] == "aoti" and m["device"] == {"type": "cpu"}
    assert m["versions"]["torch"] == torch.__version__
    assert set(m["networks"]) == {"target", "draft_context", "draft_block"}
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
