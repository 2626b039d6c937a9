"""The OpenAI-compatible front end on the default pair: a real uvicorn server on loopback (in a
thread of this process, so the tests can look at the engine's KV page pool), driven with the
official ``openai`` client and httpx; outputs compared with ``LLM.generate`` at temperature 0."""
from __future__ import annotations

import json
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.support.openai_serving import default_pair_llm, default_pair_template, serving  # noqa: E402

API_KEY = "test-key-123"
MODEL = "dspark-default"
MAX_BODY = 64 * 1024
PROMPTS = ["Once upon a time", "The cat sat", "def main():", "import numpy as np\n", "In 1492,",
           "Hello world", "The quick brown fox", "class Node:", "for i in range(10):", "# TODO:",
           "She said", "x = [", "while True:", "return self.", "The results show", "print("]


@pytest.fixture(scope="module")
def reference_llm():
    """A second copy of the default pair: LLM.generate must not share the server's caches."""
    return default_pair_llm()


@pytest.fixture(scope="module")
def served():
    with serving(default_pair_llm(), MODEL, default_pair_template(), max_request_bytes=MAX_BODY,
                 api_key=API_KEY) as (server, thread):
        yield server, thread


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1].url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


def reference(llm, prompt, max_tokens):
    out = llm.generate(prompt, SamplingParams(max_new_tokens=max_tokens))[0]
    return out.output_ids, out.text, out.finish_reason


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if c.object == "chat.completion.chunk"
                   else c.choices[0].text for c in chunks if c.choices)
    return text, chunks


# ---- outputs equal LLM.generate ------------------------------------------------------------------
def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}


def test_completion_equals_generate(client, reference_llm):
    ids, text, reason = reference(reference_llm, PROMPTS[0], 40)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == ids and choice.text == text and choice.finish_reason == reason
    assert r.usage.prompt_tokens == len(reference_llm.encode(PROMPTS[0]))
    assert r.usage.completion_tokens == len(ids)
    assert 1 <= r.dspark["tau"] <= 8 and len(r.dspark["acceptance_per_position"]) == 7
    assert r.dspark["committed"] == len(ids) - 1            # the prefill's first token is no round


def test_streamed_completion_equals_generate(client, reference_llm):
    ids, text, reason = reference(reference_llm, PROMPTS[1], 48)
    got, chunks = stream_text(client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=48, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert got == text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3     # really streamed
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == reason and final.choices[0].token_ids == ids
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_chat_equals_generate_on_the_rendered_template(client, reference_llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}]
    prompt = default_pair_template().render(messages)
    assert prompt == "system: You are terse.\nuser: hi there\nassistant:"
    ids, text, reason = reference(reference_llm, prompt, 32)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == text and r.choices[0].token_ids == ids
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(reference_llm.encode(prompt))
    got, chunks = stream_text(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, stream=True, stream_options={"include_usage": True}))
    assert got == text and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_seeded_sampling_equals_generate_with_the_same_params(client, reference_llm):
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=1234, max_new_tokens=30)
    expected = reference_llm.generate(PROMPTS[6], params)[0]
    greedy = reference(reference_llm, PROMPTS[6], 30)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=30, temperature=0.9,
                                  top_p=0.8, seed=1234, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == expected.output_ids != greedy       # sampled, and the same draw


def test_sampling_modifiers_equal_generate_with_the_same_params(client, reference_llm):
    """vLLM's top_k / min_p / penalties reach the runtime: greedy and seeded sampled output equal
    LLM.generate with the same SamplingParams."""
    mods = dict(top_k=5, min_p=0.05, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3)
    for temperature in (0.0, 0.9):
        r = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=12, seed=3,
                                      temperature=temperature, presence_penalty=0.8,
                                      frequency_penalty=0.4, extra_body={
                                          k: mods[k] for k in ("top_k", "min_p", "repetition_penalty")})
        sp = SamplingParams(max_new_tokens=12, seed=3, temperature=temperature, **mods)
        assert r.choices[0].text == reference_llm.generate("The cat sat", sp)[0].text


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5,
                                                      "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---- concurrency -----------------------------------------------------------------------------------
def test_eight_concurrent_streaming_clients_two_requests_each(served, client, reference_llm):
    jobs = [(c, k, PROMPTS[(2 * c + k) % len(PROMPTS)], 12 + 5 * ((c + k) % 4))
            for c in range(8) for k in range(2)]
    expected = {(c, k): reference(reference_llm, p, n)[1] for c, k, p, n in jobs}
    results, errors, peak_running = {}, [], []

    def one_client(c):
        try:
            for _, k, p, n in [j for j in jobs if j[0] == c]:
                text, _ = stream_text(client.completions.create(model=MODEL, prompt=p, max_tokens=n,
                                                                stream=True))
                results[(c, k)] = text
        except Exception as e:                    # reported below, with the client number
            errors.append((c, repr(e)))
    threads = [threading.Thread(target=one_client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak_running.append(len(served[0].engine.scheduler.running))
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert not errors
    assert results == expected
    assert max(peak_running) >= 4               # requests from different clients shared the batch


# ---- stop strings ------------------------------------------------------------------------------------
def test_stop_strings_are_matched_across_tokens_and_cut(client, served):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40,
                                     extra_body={"return_token_ids": True}).choices[0]
    tok = served[0].llm.tokenizer
    ends = [len(tok.decode(full.token_ids[:i + 1])) for i in range(len(full.token_ids))]
    # a stop string that starts 1 character before a token boundary and ends 2 after it
    boundary = next(e for e in ends[5:] if 1 <= e < len(full.text) - 2 and full.text[e - 1:e + 2].strip())
    stop = full.text[boundary - 1:boundary + 2]
    cut = full.text[:full.text.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40,
                                  stop=["never-appears", stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(full.token_ids)
    got, chunks = stream_text(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40,
                                                        stop=stop, stream=True))
    assert got == cut and chunks[-1].choices[0].finish_reason == "stop"


# ---- malformed requests ----------------------------------------------------------------------------
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {**OK, "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**OK, "prompt": 5}, 400, "prompt"),
    ("completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("completions", {k: v for k, v in OK.items() if k != "model"}, 400, "model"),
    ("completions", {**OK, "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {**OK, "n": 17}, 400, "n"),                        # over MAX_N
    ("completions", {**OK, "n": 0}, 400, "n"),
    ("completions", {**OK, "prompt": ["a"] * 65}, 400, "prompt"),       # over MAX_PROMPTS
    ("completions", {**OK, "prompt": ["a"] * 8, "n": 9}, 400, "n"),     # over MAX_CHOICES
    ("completions", {**OK, "prompt": ["a", ""]}, 400, "prompt"),
    ("completions", {**OK, "top_k": -5}, 400, "top_k"),
    ("completions", {**OK, "min_p": 1.5}, 400, "min_p"),
    ("completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {**OK, "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {**OK, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("completions", {**OK, "logprobs": 21}, 400, "logprobs"),           # over MAX_LOGPROBS
    ("completions", {**OK, "logprobs": True}, 400, "logprobs"),
    ("completions", {**OK, "echo": True}, 400, "echo"),
    ("completions", {**OK, "best_of": 2}, 400, "best_of"),
    ("completions", {**OK, "bogus_field": 1}, 400, "bogus_field"),
    ("completions", {**OK, "prompt": [1, 99999]}, 400, None),          # token id outside the vocab
    ("completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat/completions", {**CHAT_OK, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT_OK, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("chat/completions", {**CHAT_OK, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {**CHAT_OK, "logprobs": 3}, 400, "logprobs"),
    ("chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),   # without logprobs
    ("chat/completions", {**CHAT_OK, "n": 100}, 400, "n"),
    ("chat/completions", {**CHAT_OK, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {**CHAT_OK, "stop": [1, 2]}, 400, "stop"),
]


def test_malformed_requests_get_openai_errors_and_the_server_stays_up(http, client):
    for path, body, status, param in BAD_REQUESTS:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
            body, bytes) else {"json": body}
        r = http.post(f"/v1/{path}", **kw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)
    r = http.post("/v1/completions", content=b"x" * (MAX_BODY + 1))
    assert r.status_code == 413 and "error" in r.json()
    assert http.get("/v1/nope").status_code == 404
    assert httpx.get(http.base_url.join("/v1/models")).status_code == 401           # no key
    assert httpx.get(http.base_url.join("/v1/models"),
                     headers={"Authorization": "Bearer wrong"}).status_code == 401
    with pytest.raises(openai.BadRequestError, match="'n' = 17"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, n=17)
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_chat_without_template_is_a_clear_400(served, http):
    server = served[0]
    saved, server.chat_template = server.chat_template, None
    try:
        r = http.post("/v1/chat/completions", json=CHAT_OK)
    finally:
        server.chat_template = saved
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_an_engine_failure_fails_its_requests_and_the_next_ones_are_served(served, http):
    engine = served[0].engine

    def broken_step():
        raise RuntimeError("injected step failure")
    engine.scheduler.step = broken_step              # the engine replaces a generator that fails
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert engine.kv_pages_free() == engine.kv_pages_total()


# ---- disconnects free KV pages -------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_sequence_and_pages(served, http):
    engine = served[0].engine
    total = engine.kv_pages_total()
    assert engine.kv_pages_free() == total
    aborted_before = aborted_count(http)
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
        assert engine.kv_pages_free() < total and engine.num_active() == 1
    deadline = time.monotonic() + 10
    while (engine.kv_pages_free() != total or engine.num_active()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv_pages_free() == total and engine.num_active() == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    wait_for_aborted_count(http, aborted_before + 1, deadline)


def aborted_count(http) -> float:
    return scrape(http, "finished_reason").get(("dspark:request_success_total", "abort"), 0.0)


def wait_for_aborted_count(http, expected: float, deadline: float) -> None:
    while aborted_count(http) != expected:
        assert time.monotonic() < deadline, f"aborted requests: {aborted_count(http)}, expected {expected}"
        time.sleep(0.02)


def test_client_that_gives_up_on_a_non_streaming_request_frees_its_pages(served, http):
    engine = served[0].engine
    total = engine.kv_pages_total()
    aborted_before = aborted_count(http)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5                    # far less than the 1,500 tokens would take
    while (engine.kv_pages_free() != total or engine.num_active()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv_pages_free() == total and engine.num_active() == 0
    wait_for_aborted_count(http, aborted_before + 1, deadline)


# ---- metrics -----------------------------------------------------------------------------------------
def scrape(http, label: str = "position") -> dict:
    """{(sample name, value of ``label`` or None): value} summed over the other labels."""
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            key = (s.name, s.labels.get(label))
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_metrics_match_the_responses(http, client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24).choices[0].text
    before = scrape(http)
    responses = [client.completions.create(model=MODEL, prompt=p, max_tokens=24) for p in PROMPTS[4:8]]
    responses.append(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                                    max_tokens=20))
    responses.append(client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24,
                                               stop=full[len(full) // 2:len(full) // 2 + 3]))
    assert responses[-1].choices[0].finish_reason == "stop"            # a request cut by a stop string
    after = scrape(http)
    delta = lambda name, pos=None: after.get((name, pos), 0.0) - before.get((name, pos), 0.0)
    accepted = sum(r.dspark["accepted"] for r in responses)
    assert accepted > 0
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == accepted
    assert delta("dspark:spec_decode_num_draft_tokens_total") == sum(r.dspark["proposed"] for r in responses)
    assert delta("dspark:spec_decode_num_drafts_total") == sum(r.dspark["rounds"] for r in responses)
    per_pos = [delta("dspark:spec_decode_num_accepted_tokens_per_pos_total", str(k)) for k in range(7)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    for r in responses:                                    # tau = committed tokens per round
        assert r.dspark["tau"] == pytest.approx(r.dspark["committed"] / r.dspark["rounds"])
    assert delta("dspark:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert delta("dspark:generation_tokens_total") == sum(r.usage.completion_tokens for r in responses)
    assert delta("dspark:time_to_first_token_seconds_count") == len(responses)
    assert delta("dspark:inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in responses)
    assert after[("dspark:num_requests_waiting", None)] == 0
    assert after[("dspark:kv_cache_pages_in_use", None)] == 0
    assert after[("dspark:kv_cache_pages_total", None)] > 0


# ---- the CLI --------------------------------------------------------------------------------------
def test_cli_serve_openai_process_answers_and_stops_on_sigint(tmp_path):
    """``dspark-trt serve`` (the OpenAI server is the default) as a real process on loopback: health, one completion with the
    bearer key, then SIGINT ends it with status 0."""
    import os
    import signal
    import subprocess
    import sys

    from dspark_trt.openai_server.launch import free_port
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "serve", "--port", str(port),
                             "--api-key", "k", "--max-batch-size", "2", "--max-seq-len", "256",
                             "--model-name", "tiny"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30)
        r = c.completions.create(model="tiny", prompt="Hello", max_tokens=6)
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=3).usage.completion_tokens == 3
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 300},
                       headers={"Authorization": "Bearer k"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"    # 256 context
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    assert rc == 0, (tmp_path / "serve.log").read_text()
