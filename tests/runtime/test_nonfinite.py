"""NaN / Inf never turn into silent output: refused at checkpoint load (the tensor named), and
non-finite logits at run time end that request with finish_reason "error" and a message."""
from __future__ import annotations

import json

import pytest
import torch

from dspark_trt.builder.build import BuildOptions, build_engine
from dspark_trt.checkpoints.files import CheckpointError, write_checkpoint
from dspark_trt.checkpoints.qwen3 import qwen3_draft_tensors, qwen3_target_tensors
from dspark_trt.cli import main
from dspark_trt.models import build_models
from dspark_trt.runtime.scheduler import NONFINITE_LOGITS
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import tiny_pair

BAD_WEIGHT = "model.layers.1.mlp.down_proj.weight"
TINY = "qwen3-tiny-dspark"


def write_pair_with(tmp_path, value: float):
    """A tiny checkpoint pair whose target has ``value`` in one entry of one MLP weight."""
    pair = tiny_pair()
    target, draft = build_models(pair, torch.float32, "cpu", seed=1)
    tensors = qwen3_target_tensors(target)
    tensors[BAD_WEIGHT] = tensors[BAD_WEIGHT].clone()
    tensors[BAD_WEIGHT][3, 5] = value
    write_checkpoint(tmp_path / "t", pair.target.to_hf(), tensors)
    write_checkpoint(tmp_path / "d", pair.draft.to_hf(), qwen3_draft_tensors(draft))
    return tmp_path / "t", tmp_path / "d"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_checkpoint_with_non_finite_weight_is_refused_naming_the_tensor(tmp_path, value):
    t, d = write_pair_with(tmp_path, value)
    with pytest.raises(CheckpointError, match=f"tensor '{BAD_WEIGHT}' in .* non-finite"):
        LLM.from_checkpoints(t, d, device="cpu")


def test_cli_generate_and_build_refuse_a_nan_checkpoint(tmp_path, capsys):
    t, d = write_pair_with(tmp_path, float("nan"))
    rc = main(["generate", "--checkpoint", str(t), "--draft-checkpoint", str(d), "--device", "cpu",
               "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: tensor") and BAD_WEIGHT in err and err.count("\n") == 1
    with pytest.raises(CheckpointError, match=BAD_WEIGHT):        # at the load stage: nothing compiled
        build_engine(BuildOptions(model="x", checkpoint=str(t), draft_checkpoint=str(d), device="cpu",
                                  output=str(tmp_path / "eng"), check_toolchain=False),
                     report=lambda m: None)
    assert not (tmp_path / "eng").exists()


@pytest.fixture
def llm():
    return LLM.from_preset(TINY, device="cpu", max_seq_len=64, max_batch_size=2)


def poison_(llm: LLM) -> None:
    """NaN in one MLP weight of the loaded target (past the load check, e.g. an fp16 overflow)."""
    with torch.no_grad():
        dict(llm.target.named_parameters())[BAD_WEIGHT][0, 0] = float("nan")


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_logits_end_the_request_with_an_error_not_a_stop(llm, speculative, temperature):
    poison_(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=temperature, seed=1),
                       speculative=speculative)[0]
    assert out.finish_reason == "error" and out.error == NONFINITE_LOGITS
    assert out.output_ids == []


def corrupt_target_call(llm: LLM, call: int, row: int, batch: int) -> None:
    """From the ``call``-th target call on, row ``row`` of the logits is NaN while the batch has
    ``batch`` rows (the other rows untouched)."""
    nets, real, calls = llm.networks, llm.networks.target, []

    def target(tokens, positions, table):
        logits, taps = real(tokens, positions, table)
        calls.append(1)
        if len(calls) >= call and logits.shape[0] == batch:
            logits = logits.clone()
            logits[row, -1, 7] = float("nan")        # one entry of one position is enough
        return logits, taps
    nets.target = target


@pytest.mark.parametrize("speculative", [True, False])
def test_non_finite_logits_mid_generation_stop_only_that_request(llm, speculative):
    prompts, sp = [[5, 6, 7], [9, 10, 11, 12]], SamplingParams(max_new_tokens=12)
    clean = llm.generate(prompts, sp, speculative=speculative)
    corrupt_target_call(llm, call=3, row=0, batch=2)  # prefill, one round, then row 0 goes bad
    chunks = list(llm.stream_batch(prompts, sp, speculative=speculative))
    bad = [c for c in chunks if c.index == 0]
    assert bad[-1].finish_reason == "error" and bad[-1].error == NONFINITE_LOGITS
    got = [t for c in bad for t in c.token_ids]
    assert 1 <= len(got) < 12 and got == clean[0].output_ids[:len(got)]   # kept what was committed
    good = [c for c in chunks if c.index == 1]
    assert [t for c in good for t in c.token_ids] == clean[1].output_ids
    assert good[-1].finish_reason == clean[1].finish_reason and good[-1].error is None


def test_cli_generate_reports_the_error_in_json_and_exit_code(llm, monkeypatch, capsys):
    poison_(llm)
    monkeypatch.setattr(LLM, "from_preset", classmethod(lambda cls, *a, **k: llm))
    rc = main(["generate", "--model", TINY, "--device", "cpu", "--prompt-ids", "1,2,3", "--json",
               "--max-new-tokens", "8", "--max-seq-len", "64"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)                                   # --json: stdout is the JSON alone
    assert rc == 1 and out["finish_reason"] == "error" and out["error"] == NONFINITE_LOGITS
    *notes, last = cap.err.strip().splitlines()                 # notes, then the error line
    assert last == f"error: {NONFINITE_LOGITS}" and all(n.startswith("[dspark-trt]") for n in notes)
