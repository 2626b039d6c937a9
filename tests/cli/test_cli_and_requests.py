"""`dspark-trt generate` end to end, and request validation (errors name the field, others run)."""
from __future__ import annotations

import json

import pytest
import torch

from dspark_trt.cli import main
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams


def test_generate_random_preset_says_so_and_reports_statistics(capsys):
    rc = main(["generate", "--model", "qwen3-tiny-dspark", "--prompt-ids", "1,2,3",
               "--max-new-tokens", "10", "--device", "cpu", "--dtype", "fp32"])
    cap = capsys.readouterr()
    out = cap.out
    assert rc == 0
    assert "RANDOM weights" in cap.err and "RANDOM weights" not in out     # notes on stderr
    assert "mean accepted length tau" in out and "acceptance per position" in out


def test_generate_json_is_lossless_against_no_speculative(capsys):
    args = ["generate", "--model", "qwen3-tiny-dspark", "--prompt-ids", "5,6,7,8", "--max-new-tokens",
            "12", "--device", "cpu", "--dtype", "fp64", "--json"]
    main(args)
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    main(args + ["--no-speculative"])
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["output_ids"] == ar["output_ids"] and len(spec["output_ids"]) == 12
    assert spec["stats"]["rounds"] > 0 and 1.0 <= spec["stats"]["tau"] <= 5.0


def test_bad_request_is_a_clear_cli_error(capsys):
    rc = main(["generate", "--model", "qwen3-tiny-dspark", "--prompt-ids", "1", "--max-new-tokens", "0",
               "--device", "cpu"])
    assert rc == 2 and "max_new_tokens must be a positive integer" in capsys.readouterr().err
    rc = main(["generate", "--model", "no-such-model", "--device", "cpu"])
    assert rc == 2 and "unknown preset 'no-such-model'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_seq_len=64,
                           max_batch_size=2)


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 512], SamplingParams(), "token id 512 is outside the vocabulary"),
    ([1] * 60, SamplingParams(max_new_tokens=10), "exceeds max_seq_len 64"),
    ([1], SamplingParams(temperature=-1.0), "temperature must be >= 0"),
    ([1], SamplingParams(top_p=0.0), "top_p must be in"),
    ([1], SamplingParams(seed=-5), "seed must be in"),
    ("text", SamplingParams(), "no tokenizer"),
])
def test_bad_requests_name_the_problem(llm, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], params)


def test_a_rejected_request_loses_nothing_already_accepted(llm):
    gen = llm.scheduler()
    good = gen.add_request([1, 2, 3], SamplingParams(max_new_tokens=6))
    with pytest.raises(RequestError):
        gen.add_request([1, 999], SamplingParams())
    while gen.has_work():
        gen.step()
    assert len(good.output_ids) == 6 and good.finish_reason == "length"
    assert good.output_ids == llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6))[0].output_ids


def test_stream_yields_the_final_tokens(llm):
    sp = SamplingParams(max_new_tokens=9, temperature=0.8, seed=3)
    chunks = list(llm.stream([4, 5, 6], sp))
    assert [t for c in chunks for t in c] == llm.generate([[4, 5, 6]], sp)[0].output_ids


def test_build_command_maps_flags_to_build_options(monkeypatch):
    """``dspark-trt build`` flags reach BuildOptions (here: --skip-toolchain-check, the sampler)."""
    import dspark_trt.builder.build as build
    from dspark_trt.cli import main
    seen = {}
    monkeypatch.setattr(build, "build_engine", lambda opts, report: seen.update(opts=opts))
    assert main(["build", "--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                 "--markov-sampler", "topk", "--skip-toolchain-check"]) == 0
    assert seen["opts"].check_toolchain is False and seen["opts"].markov_sampler == "topk"
    main(["build", "--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu"])
    assert seen["opts"].check_toolchain is True


def test_recorded_build_command_rebuilds_the_same_options(monkeypatch, tmp_path):
    """The manifest's ``build_command`` (``BuildOptions.command_line``), run again, gives the same
    options: no flag that changes the engine (here --quantization fp8, --num-spec-tokens, the
    sampler, the sizes) is left out."""
    import shlex

    import dspark_trt.builder.build as build
    from dspark_trt.cli import main
    seen = []
    monkeypatch.setattr(build, "build_engine", lambda opts, report: seen.append(opts))
    argv = ["build", "--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
            "--quantization", "fp8", "--num-spec-tokens", "3", "--markov-sampler", "topk",
            "--max-batch-size", "4", "--max-seq-len", "256", "--page-size", "32",
            "--output", str(tmp_path / "e")]
    assert main(argv) == 0
    first = seen[-1].resolved()
    assert main(shlex.split(first.command_line())[1:]) == 0
    again = seen[-1].resolved()
    skip = {"check_toolchain", "output_note"}
    assert {k: v for k, v in vars(again).items() if k not in skip} == \
        {k: v for k, v in vars(first).items() if k not in skip}
