"""``dspark-trt serve --tp-size 2`` under torchrun on CPU (gloo): rank 0 serves the OpenAI API and
leads, rank 1 replays its scheduler (``parallel.replica``). 16 concurrent streaming completions
(the official ``openai`` client, temperature 0) equal the single process's ``LLM.generate`` token
for token (float64 tiny Qwen3 pair, token-id prompts)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

openai = pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_trt.runtime.llm import LLM  # noqa: E402
from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.support.ports import free_port, wait_serving  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET, WORLD, TOKENS = "qwen3-tiny-dspark", 2, 10
PROMPTS = [[3 + i, 17 + 2 * i, 40 + i % 5, 9] for i in range(16)]


async def _stream_all(url: str) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        ids = None
        stream = await client.completions.create(model="tp", prompt=prompt, max_tokens=TOKENS,
                                                 stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            for c in chunk.choices:
                if c.finish_reason is not None:
                    ids = (c.model_extra or {}).get("token_ids") or getattr(c, "token_ids", None)
        return ids

    try:
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    finally:
        await client.close()


def test_serve_under_torchrun_streams_what_one_process_generates():
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "dspark_trt.cli", "serve", "--tp-size", str(WORLD), "--model", PRESET,
           "--device", "cpu", "--dtype", "fp64", "--max-batch-size", "8", "--max-seq-len", "64",
           "--port", str(port), "--model-name", "tp"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, lambda: proc.poll() is None,
                     lambda: "" if proc.poll() is None    # its output only once it exited (no block)
                     else f"exit {proc.returncode}: {proc.stdout.read()[-3000:]}", 150.0)
        got = asyncio.run(_stream_all(url))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ref = LLM.from_preset(PRESET, dtype=torch.float64, device="cpu", max_batch_size=8, max_seq_len=64)
    want = [o.output_ids for o in ref.generate(PROMPTS, SamplingParams(max_new_tokens=TOKENS))]
    assert got == want
