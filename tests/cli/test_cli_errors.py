"""User errors are one ``error: <message>`` line on stderr with exit code 2, found before any model
loads; the Python API raises ``ValueError`` with the same message (#19, items 6 and 7)."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_trt import cli
from dspark_trt.cli import main
from dspark_trt.checkpoints import prepare as prepare_mod
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TINY = "qwen3-tiny-dspark"
GEN = ["generate", "--model", TINY, "--device", "cpu"]


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_error_line(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize("args,needles", [
    (["--prompt-ids", " , "], ["--prompt-ids", "no token ids"]),
    (["--prompt-ids", "1,2,abc"], ["'abc' is not an integer token id"]),
    (["--prompt-ids", ""], ["--prompt-ids ''", "no token ids"]),
    (["--prompt-ids", "1,-3"], ["token id -3 is negative"]),
    (["--prompt-ids", "1", "--temperature", "inf"], ["temperature must be >= 0 and finite", "inf"]),
    (["--prompt-ids", "1", "--temperature", "nan"], ["temperature must be >= 0 and finite"]),
    (["--prompt-ids", "1", "--temperature", "-0.5"], ["temperature must be >= 0"]),
    (["--prompt-ids", "1", "--top-p", "1.5"], ["top_p must be in (0, 1]"]),
    (["--prompt-ids", "1", "--top-p", "0"], ["top_p must be in (0, 1]"]),
    (["--prompt-ids", "1", "--top-k", "-3"], ["top_k must be an integer >= 1"]),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], ["repetition_penalty must be > 0"]),
    (["--prompt-ids", "1,2", "--max-new-tokens", "99999999999"],
     ["max_new_tokens (99999999999) exceeds max_seq_len 4096"]),
    (["--prompt-ids", "1", "--max-seq-len", "99999999999"], ["exceeds the model's context of 4096"]),
    (["--prompt", "a", "--prompt-ids", "1"], ["--prompt or --prompt-ids, not both"]),
    (["--prompt", "caf\udce9"], ["not valid UTF-8"]),
    (["--device", "gpu"], ["device 'gpu'"]),
])
def test_generate_argument_errors_come_before_any_model_loads(capsys, monkeypatch, args, needles):
    monkeypatch.setattr(prepare_mod, "build_models", _refuse)
    rc, out, err = run_cli(capsys, *GEN, *args)
    assert_error_line(rc, err, *needles)
    assert "RANDOM weights" not in out + err


def _refuse(*a, **k):
    raise AssertionError("a model was loaded before the arguments were checked")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_an_error_for_generate_build_and_the_api(capsys, monkeypatch):
    monkeypatch.setattr(prepare_mod, "build_models", _refuse)
    rc, _, err = run_cli(capsys, *GEN, "--device", "cuda", "--prompt-ids", "1")
    assert_error_line(rc, err, "device 'cuda': CUDA is not available")
    rc, out, err = run_cli(capsys, "build", "--model", TINY, "--random-weights", "--device", "cuda")
    assert_error_line(rc, err, "CUDA is not available")
    assert "[build]" not in out
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM.from_preset(TINY, device="cuda")


def test_unknown_model_is_an_error_before_the_random_weights_notice(capsys):
    for cmd in (GEN, ["build", "--random-weights", "--device", "cpu"]):
        rc, out, err = run_cli(capsys, *cmd[:1], *cmd[1:], "--model", "no-such-model")
        assert_error_line(rc, err, "unknown preset 'no-such-model'")
        assert out == ""


def test_build_refuses_a_max_seq_len_beyond_the_context_before_loading(capsys, monkeypatch, tmp_path):
    from dspark_trt.builder import build as build_mod
    monkeypatch.setattr(build_mod, "load_models", _refuse)
    rc, out, err = run_cli(capsys, "build", "--model", TINY, "--random-weights", "--device", "cpu",
                           "--max-seq-len", "99999", "--output", str(tmp_path / "e"))
    assert_error_line(rc, err, "max_seq_len=99999 exceeds the model's context of 4096")
    assert out == "" and os.listdir(tmp_path) == []


def test_random_weights_notice_matches_the_measured_acceptance(capsys):
    rc, out, err = run_cli(capsys, *GEN, "--prompt-ids", "1,2,3", "--max-new-tokens", "48", "--json")
    notice, result = err.strip().splitlines()[0], json.loads(out)     # --json: stdout is the JSON
    assert rc == 0 and "RANDOM weights" in notice and "acceptance will be low, tau near 1" in notice
    assert 1.0 <= result["stats"]["tau"] < 1.5              # random weights: near 1, as the notice says


def write_manifest_only(tmp_path, n: int = 4, sampler: str = "exact") -> Path:
    """An engine directory with only its manifest: enough for the checks made before loading."""
    d = tmp_path / "eng"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({
        "format_version": 1, "backend": "aoti", "tp_size": 1, "files": {},
        "shapes": {"num_spec_tokens": n}, "build_options": {"markov_sampler": sampler}}))
    return d


def test_engine_compiled_in_settings_cannot_be_changed_silently(tmp_path, capsys):
    eng = write_manifest_only(tmp_path, n=4, sampler="exact")
    base = ["generate", "--engine", str(eng), "--device", "cpu", "--prompt-ids", "1"]
    rc, _, err = run_cli(capsys, *base, "--markov-sampler", "topk")
    assert_error_line(rc, err, "markov_sampler='exact'", "--markov-sampler topk")
    rc, _, err = run_cli(capsys, *base, "--num-spec-tokens", "2")
    assert_error_line(rc, err, "built with num_spec_tokens=4", "--num-spec-tokens 2")
    rc, _, err = run_cli(capsys, *base, "--draft-vocab", "v.json")
    assert_error_line(rc, err, "--draft-vocab v.json", "compiled in")
    with pytest.raises(ValueError, match="built with num_spec_tokens=4"):
        LLM.from_engine(eng, device="cpu", num_spec_tokens=2)
    with pytest.raises(ValueError, match="markov_sampler='exact'"):
        LLM.from_engine(eng, device="cpu", markov_sampler="topk")


def test_non_utf8_prompt_bytes_on_the_command_line_are_an_error():
    """Real argv bytes (Latin-1 'café'): Python decodes them with surrogate escapes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}
    argv = [sys.executable.encode(), b"-m", b"dspark_trt.cli", *[a.encode() for a in GEN],
            b"--prompt", b"caf\xe9"]
    r = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err
    assert err.startswith("error: prompt is not valid UTF-8") and err.count("\n") == 1


def test_every_subcommand_help_shows_the_defaults():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    checked = 0
    for name, p in sub.choices.items():
        for a in p._actions:
            if not a.option_strings or a.default is None or a.default is False or a.default is argparse.SUPPRESS:
                continue
            fmt = p._get_formatter()
            fmt.add_argument(a)
            text = " ".join(fmt.format_help().split())
            assert "default" in text.lower(), f"{name} {a.option_strings[0]}: {text}"
            written = (a.help or "").lower()          # help that states its default in words stays
            if "default" not in written or "%(default)" in written:
                assert str(a.default) in text, f"{name} {a.option_strings[0]}: {text}"
            checked += 1
    assert checked > 30


# ---- the Python API: ValueError with the same messages ----------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset(TINY, dtype=torch.float32, device="cpu", max_seq_len=64, max_batch_size=2)


@pytest.mark.parametrize("params,match", [
    (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    (dict(temperature=math.nan), "temperature must be >= 0 and finite"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature="0.5"), "temperature must be"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=True), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a positive integer"),
    (dict(seed=1.5), r"seed must be in \[0, 2\*\*63\)"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids must be non-negative integers"),
])
def test_sampling_params_reject_what_cannot_be_sampled(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params).validate()


def test_huge_max_new_tokens_is_an_error_not_a_wrap(llm):
    with pytest.raises(ValueError, match=r"max_new_tokens \(99999999999\) = 100000000002 exceeds max_seq_len 64"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=99999999999))
    with pytest.raises(ValueError, match="exceeds the model's context of 4096"):
        LLM.from_preset(TINY, device="cpu", max_seq_len=10**11)


@pytest.mark.parametrize("make", [
    lambda ids: np.array(ids), lambda ids: np.array(ids, dtype=np.int32), lambda ids: torch.tensor(ids),
    lambda ids: [np.int64(t) for t in ids], lambda ids: tuple(ids)])
def test_integer_arrays_and_tensors_are_token_id_prompts(llm, make):
    sp = SamplingParams(max_new_tokens=6)
    want = llm.generate([[4, 5, 6]], sp)[0].output_ids
    assert llm.generate(make([4, 5, 6]), sp)[0].output_ids == want
    assert [o.output_ids for o in llm.generate([make([4, 5, 6]), [4, 5, 6]], sp)] == [want, want]


@pytest.mark.parametrize("prompt,match", [
    (np.array([1.0, 2.0]), "numpy.ndarray of dtype float64"),
    (torch.tensor([[1, 2], [3, 4]]), r"torch.Tensor of dtype torch.int64 and shape \(2, 2\)"),
    (torch.tensor([True, False]), "dtype torch.bool"),
    ([1.5, 2], "token ids must be integers; got float 1.5"),
    ({1, 2}, "got set"),
    (7, "got int"),
    ("caf\udce9", "not valid UTF-8"),
])
def test_other_prompt_types_are_a_value_error_naming_the_type(llm, prompt, match):
    if isinstance(prompt, str):
        llm.tokenizer = _Whitespace()
    try:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, SamplingParams(max_new_tokens=4))
    finally:
        llm.tokenizer = None


class _Whitespace:
    """A stand-in tokenizer (the tiny preset has none): the UTF-8 check comes before it."""

    def encode(self, text):
        raise AssertionError("the tokenizer saw text that is not UTF-8")
