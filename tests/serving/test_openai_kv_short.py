"""The OpenAI server when KV memory is short: more concurrent streams than the cache holds at
full length; sequences are preempted and recomputed, and every stream still equals
``LLM.generate`` token for token (temperature 0), each token sent once."""
from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.support.openai_serving import default_pair_llm, serving  # noqa: E402

PROMPTS = ["Once upon a time", "The cat sat", "def main():", "import numpy as np\n", "In 1492,",
           "Hello world"]
MAX_TOKENS = 24
PAGES = 10             # pages of 8 tokens: 6 requests x (~5 + 24 + the block) tokens need ~30


def test_concurrent_streams_with_a_short_cache_equal_generate():
    llm = default_pair_llm(max_batch_size=8, max_seq_len=128, page_size=8, num_pages=PAGES)
    want = [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_TOKENS,
                                                                       ignore_eos=True))]

    async def one(client, prompt):
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                 stream=True, extra_body={"return_token_ids": True,
                                                                          "ignore_eos": True})
        text, ids = [], None
        async for chunk in stream:
            for c in chunk.choices:
                text.append(c.text)
                if c.finish_reason is not None:
                    ids = c.model_extra["token_ids"]
        return "".join(text), ids

    async def run():
        client = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))
    with serving(llm, "m") as (server, thread):
        got = asyncio.run(run())
        preemptions = server.engine.scheduler.preemptions
        free = server.engine.kv_pages_free()
    assert preemptions > 0, "the cache was not short: nothing was preempted"
    for (text, ids), w in zip(got, want):
        assert ids == w
        assert text == llm.decode(w)                 # streamed text: every token once, in order
    assert free == PAGES
