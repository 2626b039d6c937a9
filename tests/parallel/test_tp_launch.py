"""Launching tensor parallelism on CPU over gloo: ``bench`` under torchrun, and the Triton model
instance as rank 0 that starts rank 1 itself (``parallel.launch`` + ``parallel.replica``).

Both compare with the single process token for token (float64 tiny Qwen3 pair).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams
from dspark_trt.serving.source import ServedModel

from tests.support.fake_pb import FakePB, ids_request
from tests.support.ports import free_port as _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = "qwen3-tiny-dspark"


@pytest.fixture(scope="module")
def single():
    return LLM.from_preset(PRESET, dtype=torch.float64, device="cpu", max_batch_size=4, max_seq_len=64)


def test_bench_under_torchrun_rank0_writes_one_report(tmp_path, single):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "dspark_trt.cli", "bench", "--tp-size", "2", "--model", PRESET, "--random-weights",
           "--device", "cpu", "--dtype", "fp64", "--batch-sizes", "1,2", "--prompt-len", "8",
           "--gen-len", "6", "--iters", "1", "--hf", "eager", "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = tmp_path.glob("bench-cpu-tp2-*.json")                 # rank 0 only
    rep = json.loads(path.read_text())
    assert rep["parallel"] == {"tp_size": 2, "world": 2, "nodes": 1, "expert_parallel": False}
    assert "tensor parallel" in rep["hf_peer"]["skipped"]
    prompts = np.random.default_rng(0).integers(0, single.pair.target.vocab_size, (2, 8))
    for b in ("1", "2"):
        row = rep["batch"][b]
        assert row["verify_step_ms"] > 0 and row["target_weight_bytes"] > 0
        want = single.generate(prompts[0].tolist(), SamplingParams(max_new_tokens=6, ignore_eos=True),
                               speculative=False)[0].output_ids
        assert row["autoregressive"]["output_ids_row0"] == want
        assert row["speculative"]["output_ids_row0"] == want


@pytest.fixture(scope="module")
def tp_model():
    """DSparkModel with tp_size=2 in this process (rank 0); it spawns rank 1 itself."""
    from dspark_trt.serving.triton_model import DSparkModel
    env = dict(os.environ)
    src = ServedModel(model=PRESET, random_weights=True, dtype="fp64", device="cpu",
                      max_batch_size=4, max_seq_len=64, tp_size=2)
    params = {k: {"string_value": v} for k, v in {**src.to_parameters(), "default_max_tokens": "8",
                                                   "cpu_threads": "1"}.items()}
    m = DSparkModel(FakePB, {"model_config": json.dumps({"name": "dspark", "parameters": params}),
                             "model_version": "1", "model_instance_kind": "CPU"})
    try:
        yield m
    finally:
        m.finalize()
        os.environ.clear()
        os.environ.update(env)
    assert [p.returncode for p in m.followers] == [0]            # rank 1 left cleanly on stop


def test_triton_model_leads_a_second_rank_and_matches_one_process(tp_model, single):
    assert len(tp_model.followers) == 1 and tp_model.llm.tp_size == 2
    prompts = [[5 + i, 17, 33, 3 + 2 * i] for i in range(5)]
    temps = [0.0, 0.8, 0.0, 1.0, 0.0]
    reqs = [ids_request(p, 10, seed=100 + i, temperature=t)
            for i, (p, t) in enumerate(zip(prompts, temps))]
    unseeded = ids_request([9, 8, 7], 10, temperature=1.0)         # seed drawn on rank 0, broadcast
    streamed = ids_request([4, 4, 2], 12, seed=3, temperature=1.0, stream=True)
    tp_model.execute(reqs[:2])
    tp_model.execute(reqs[2:] + [unseeded, streamed])
    want = single.generate(prompts, [SamplingParams(temperature=t, max_new_tokens=10, seed=100 + i)
                                     for i, t in enumerate(temps)])
    for r, w in zip(reqs, want):
        (resp,) = r.wait(timeout=120)
        assert resp.error is None and resp.outputs["output_ids"].tolist() == w.output_ids
    (resp,) = unseeded.wait(timeout=120)
    assert resp.error is None and len(resp.outputs["output_ids"]) == 10
    chunks = streamed.wait(timeout=120)
    got = sum((c.outputs["output_ids"].tolist() for c in chunks), [])
    assert got == single.generate([4, 4, 2], SamplingParams(temperature=1.0, max_new_tokens=12,
                                                             seed=3))[0].output_ids


def test_tp_repository_serves_one_instance(tmp_path):
    from dspark_trt.serving.repository import write_repository
    src = ServedModel(model=PRESET, random_weights=True, device="cuda", tp_size=2)
    text = (write_repository(tmp_path, src) / "config.pbtxt").read_text()
    assert "count: 1 kind: KIND_CPU" in text and '"tp_size" value: { string_value: "2"' in text
    with pytest.raises(ValueError, match="serve one instance"):
        write_repository(tmp_path / "b", src, instance_count=2)
