"""benchmarks/openai_load.py's two HTTP clients (the official ``openai`` one, and ``httpx`` with
its own server-sent-event parsing, for machines without the openai package such as the H200
image): over the same server, every streamed completion's token ids equal ``LLM.generate``'s and
both clients see the same chunks per request."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.support.benchmark_scripts import load_benchmark  # noqa: E402
from tests.support.openai_serving import default_pair_llm, serving  # noqa: E402


def test_both_clients_stream_the_generated_tokens():
    mod = load_benchmark("openai_load")
    llm = default_pair_llm(max_batch_size=4, max_seq_len=128)
    prompts = mod.PROMPTS[:3]
    expected = [o.output_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6))]
    got = {}
    with serving(llm, "dspark") as (_, thread):
        for kind in ("openai", "httpx"):
            _, stats, results, jobs = asyncio.run(mod.run_load(thread.url, "dspark", prompts, 3, 1, 6, kind))
            got[kind] = (results, stats["chunks"])
            for c in range(3):
                (key, prompt, _), = jobs[c]
                assert results[key] == expected[prompts.index(prompt)], (kind, prompt)
            assert len(stats["ttft"]) == 3 and len(stats["e2e"]) == 3
    assert got["openai"] == got["httpx"]
