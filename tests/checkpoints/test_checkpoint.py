"""HF checkpoint round trips (single file and shards) and every bad-input case, all-or-nothing."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dspark_trt.checkpoints.files import CheckpointError, read_tensors, write_checkpoint
from dspark_trt.checkpoints.qwen3 import (load_qwen3_pair, qwen3_draft_tensors,
                                             qwen3_target_tensors)
from dspark_trt.models import build_models
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import tiny_pair


def write_pair(tmp_path, shard: int | None = None, include_shared=True, confidence=True):
    pair = tiny_pair(rank=4)
    target, draft = build_models(pair, torch.float32, "cpu", seed=3)
    tdir, ddir = tmp_path / "target", tmp_path / "draft"
    write_checkpoint(tdir, pair.target.to_hf(), qwen3_target_tensors(target), max_shard_bytes=shard)
    dt = qwen3_draft_tensors(draft, include_shared=include_shared)
    if confidence:         # published DSpark drafts ship a confidence head: accepted and ignored
        dt["confidence_head.proj.weight"] = torch.randn(1, pair.target.hidden_size + 4)
        dt["confidence_head.proj.bias"] = torch.zeros(1)
    write_checkpoint(ddir, pair.draft.to_hf(), dt, max_shard_bytes=shard)
    return pair, target, draft, tdir, ddir


@pytest.mark.parametrize("shard", [None, 20_000])
def test_round_trip_loads_identical_weights_and_outputs(tmp_path, shard):
    pair, target, draft, tdir, ddir = write_pair(tmp_path, shard)
    if shard:
        assert (tdir / "model.safetensors.index.json").exists()
        assert len(list(tdir.glob("model-*.safetensors"))) > 1
    _, t2, d2 = load_qwen3_pair(tdir, ddir)
    for (n, a), (_, b) in zip(target.state_dict().items(), t2.state_dict().items()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(draft.state_dict().items(), d2.state_dict().items()):
        assert torch.equal(a, b), n
    assert d2.embed_tokens is t2.model.embed_tokens and d2.lm_head is t2.lm_head   # shared, not copied
    a = LLM(pair, target, draft).generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))[0]
    b = LLM.from_checkpoints(tdir, ddir, device="cpu").generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))[0]
    assert a.output_ids == b.output_ids


def test_draft_without_shared_copies_uses_the_targets(tmp_path):
    _, target, _, tdir, ddir = write_pair(tmp_path, include_shared=False, confidence=False)
    _, t2, d2 = load_qwen3_pair(tdir, ddir)
    assert torch.equal(d2.lm_head.weight, target.lm_head.weight)


def _edit_single(path, fn):
    tensors = read_tensors(path.parent)
    fn(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("case,match", [
    ("missing", r"parameter 'fc.weight' is missing"),
    ("unexpected", r"unexpected tensor 'extra.weight' in .*model.safetensors"),
    ("shape", r"tensor 'fc.weight' in .*model.safetensors has shape \(3, 3\), expected"),
    ("dtype", r"tensor 'fc.weight' in .*non-float dtype torch.int32"),
    ("truncated", r"model.safetensors: unreadable safetensors file"),
    ("no_weights", r"neither model.safetensors nor model.safetensors.index.json"),
    ("missing_shard", r"shard listed in model.safetensors.index.json is missing"),
    ("shared_shape", r"draft tensor 'lm_head.weight' .* has shape \(3, 3\), target has"),
])
def test_bad_draft_checkpoint_is_refused_and_nothing_is_half_loaded(tmp_path, case, match):
    pair, target, draft, tdir, ddir = write_pair(tmp_path, shard=20_000 if case == "missing_shard" else None)
    f = ddir / "model.safetensors"
    if case == "missing":
        _edit_single(f, lambda t: t.pop("fc.weight"))
    elif case == "unexpected":
        _edit_single(f, lambda t: t.update({"extra.weight": torch.zeros(2)}))
    elif case == "shape":
        _edit_single(f, lambda t: t.update({"fc.weight": torch.zeros(3, 3)}))
    elif case == "dtype":
        _edit_single(f, lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int32)}))
    elif case == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    elif case == "no_weights":
        f.unlink()
    elif case == "missing_shard":
        next(ddir.glob("model-00001-*.safetensors")).unlink()
    elif case == "shared_shape":
        _edit_single(f, lambda t: t.update({"lm_head.weight": torch.zeros(3, 3)}))
    fresh_target, fresh_draft = build_models(pair, torch.float32, "cpu", seed=99)
    before = {k: v.clone() for k, v in fresh_draft.state_dict().items()}
    from dspark_trt.checkpoints.files import load_into_module
    from dspark_trt.checkpoints.qwen3 import _draft_rename
    with pytest.raises(CheckpointError, match=match):
        load_qwen3_pair(tdir, ddir)
    if case not in ("shared_shape",):       # the module-level loader itself is all-or-nothing
        with pytest.raises(CheckpointError):
            load_into_module(fresh_draft, ddir, rename=_draft_rename,
                             skip=lambda n: n.split(".")[0] in ("embed_tokens", "lm_head"))
        for k, v in fresh_draft.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} was modified by a failed load"


def test_bad_config_names_the_field(tmp_path):
    _, _, _, tdir, ddir = write_pair(tmp_path)
    cfg = json.loads((ddir / "config.json").read_text())
    cfg["target_layer_ids"] = [0, cfg["num_target_layers"] - 1]
    (ddir / "config.json").write_text(json.dumps(cfg))
    from dspark_trt.config import ConfigError
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_qwen3_pair(tdir, ddir)
    (tdir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_qwen3_pair(tdir, ddir)
