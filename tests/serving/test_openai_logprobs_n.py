"""OpenAI server: logprobs, ``n`` > 1 and prompt lists, with the official client against a real
uvicorn server on loopback (default pair). Logprobs are the raw target distribution's
(``runtime/logprobs.py``) and must equal ``LLM.generate``'s to 1e-5 (the server runs the same
steps in another batch composition: float32 rounding only)."""
from __future__ import annotations

import math
import time

import pytest

openai = pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.support.openai_serving import default_pair_llm, default_pair_template, serving  # noqa: E402

MODEL = "dspark-default"
TOL = 1e-5


@pytest.fixture(scope="module")
def reference_llm():
    return default_pair_llm()


@pytest.fixture(scope="module")
def served():
    with serving(default_pair_llm(), MODEL, default_pair_template()) as (server, thread):
        yield server, thread


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_completion_logprobs_equal_generate_streaming_or_not(client, reference_llm):
    ref = reference_llm.generate("Once upon a time", SamplingParams(max_new_tokens=12, logprobs=3))[0]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, logprobs=3,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == ref.output_ids and c.text == ref.text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for got, want, top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert abs(got - want.logprob) < TOL and got <= 0
        values = list(top.values())
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert abs(values[0] - got) < TOL                    # T = 0: the chosen token is the argmax
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] < len(c.text)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                            logprobs=3, stream=True))
    streamed = [x for ch in chunks for x in ((ch.choices[0].logprobs.token_logprobs)
                                             if ch.choices and ch.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    assert [o for ch in chunks if ch.choices and ch.choices[0].logprobs
            for o in ch.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprobs_with_top_logprobs(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, logprobs=True,
                                       top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        assert e.bytes == list(e.token.encode("utf-8")) and e.logprob <= 0
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < TOL
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, logprobs=True,
                                            top_logprobs=4, stream=True)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5))
                                                                  for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_n_samples_are_seeded_reproducible_and_distinct(client):
    kw = dict(model=MODEL, prompt="The cat sat", max_tokens=10, temperature=1.0, seed=1234)
    r = client.completions.create(n=4, extra_body={"return_token_ids": True}, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, "four samples at temperature 1 came out identical"
    assert [c.text for c in client.completions.create(n=4, **kw).choices] == texts     # reproducible
    assert client.completions.create(n=1, **kw).choices[0].text == texts[0]           # sample 0 = seed
    prompt_len = client.completions.create(n=1, **kw).usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt_len                  # the prompt counted once
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    chunks = list(client.completions.create(n=4, stream=True, stream_options={"include_usage": True}, **kw))
    got = ["".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in range(4)]
    assert got == texts and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                temperature=1.0, seed=5, n=3)
    c = client.chat.completions.create(**chat)
    assert [x.index for x in c.choices] == [0, 1, 2]
    chunks = list(client.chat.completions.create(stream=True, **chat))
    streamed = ["".join(x.delta.content or "" for ch in chunks for x in ch.choices if x.index == i)
                for i in range(3)]
    assert streamed == [x.message.content for x in c.choices]


def test_prompt_list_choices_are_prompt_major(client, reference_llm):
    prompts = ["def main():", "Hello world", "In 1492,"]
    refs = reference_llm.generate(prompts, SamplingParams(max_new_tokens=10))
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [o.text for o in refs for _ in range(2)]   # T = 0: equal
    assert r.usage.prompt_tokens == sum(len(o.prompt_ids) for o in refs)
    ids = [reference_llm.encode(p) for p in prompts]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=10)      # lists of token ids
    assert [c.text for c in r2.choices] == [o.text for o in refs]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, stream=True))
    got = ["".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in range(3)]
    assert got == [o.text for o in refs]
    finals = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert finals == {i: o.finish_reason for i, o in enumerate(refs)}


def test_a_disconnect_frees_every_choice(served):
    """n = 3 over two prompts, the stream dropped after a few chunks: all 6 sequences are aborted
    and their KV pages freed."""
    import httpx
    engine = served[0].engine
    total = engine.kv_pages_total()
    body = {"model": MODEL, "prompt": ["Once upon a time", "def main():"], "n": 3, "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served[1].url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
            assert engine.num_active() == 6 and engine.kv_pages_free() < total
    deadline = time.monotonic() + 10
    while (engine.kv_pages_free() != total or engine.num_active()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv_pages_free() == total and engine.num_active() == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
