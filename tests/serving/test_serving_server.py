"""A real tritonserver (nvidia-pytriton 2.51, CPU) serving a repository made by write_repository,
run as `dspark-trt serve --triton` runs it (ServingStack: HTTP through the gateway, the supervisor probing).

Needs the serving venv (scripts/setup_triton_env.sh; .ci/run creates it); skipped without it.
The model is the tiny preset with random weights (fixed seed) saved as HF checkpoints with a tiny
byte-level BPE tokenizer, so text goes in and out. Expected outputs come from the runtime itself
(LLM.generate in this process, same checkpoints, same seeds).
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from dspark_trt.runtime.sampling_params import SamplingParams
from dspark_trt.serving.repository import write_repository
from dspark_trt.serving.server import ServingEnvError, TritonInstall
from dspark_trt.serving.source import ServedModel
from dspark_trt.serving.stack import ServingStack

from tests.support.text_pair import make_tiny_text_pair

pytestmark = pytest.mark.server
MODEL = "dspark"
MAX_SEQ_LEN = 128
CLIENT = Path(__file__).resolve().parents[2] / "dspark_trt" / "serving" / "client.py"


@pytest.fixture(scope="module")
def install():
    try:
        return TritonInstall.find()
    except ServingEnvError as e:
        pytest.skip(f"serving venv unavailable (it needs PyPI to be created): {e}")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tdir, ddir = make_tiny_text_pair(tmp_path_factory.mktemp("tiny_pair"))
    return ServedModel(checkpoint=str(tdir), draft_checkpoint=str(ddir), device="cpu", dtype="fp32",
                       max_batch_size=16, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def llm(source):
    """The reference runtime, one torch thread like the server (CPU oversubscription is costly)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield source.load()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(install, source, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    write_repository(root / "model_repository", source, model_name=MODEL, default_max_tokens=16,
                     cpu_threads=1)
    srv = ServingStack(root / "model_repository", install, MODEL, log_path=root / "tritonserver.log",
                       ready_timeout=120)
    srv.start()
    yield srv
    srv.stop()
    assert srv.supervisor.restarts == [], "the supervisor restarted a healthy server"


def report(capsys, line: str) -> None:
    """Measured numbers go to the terminal even when pytest captures output (the lead records them)."""
    with capsys.disabled():
        print(f"\n[serving] {line}")


def generate(srv, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(f"{srv.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def as_list(v):
    assert isinstance(v, list), f"a list output came back as {v!r}"      # the gateway makes it a list
    return v


def reference(llm, prompt: str, max_tokens: int, temperature: float, seed: int):
    return llm.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=max_tokens, seed=seed))[0]


def assert_matches(got: dict, want, llm):
    assert as_list(got["output_ids"]) == want.output_ids
    assert got["text_output"] == llm.decode(want.output_ids)
    assert got["finish_reason"] == want.finish_reason
    assert got["rounds"] == want.stats.rounds
    assert got["tau"] == pytest.approx(want.stats.tau, rel=1e-6)
    assert as_list(got["acceptance_per_position"]) == pytest.approx(want.stats.acceptance_per_position(), rel=1e-6)


def client_stream(install, srv, *requests, cancel_after=None) -> list[list[dict]]:
    cmd = [str(install.python), str(CLIENT), "--url", srv.grpc_url, "--model", MODEL]
    for r in requests:
        cmd += ["--request", json.dumps(r)]
    if cancel_after:
        cmd += ["--cancel-after", str(cancel_after)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    return [[{k: v for k, v in d.items() if k != "request"} for d in lines if d["request"] == i]
            for i in range(len(requests))]


def metrics(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_http_generate_equals_runtime(server, llm, capsys):
    report(capsys, f"tritonserver start -> ready: {server.ready_seconds:.2f} s (model load and warm-up included)")
    body = {"text_input": "abc ghij kl", "max_tokens": 20, "temperature": 0.8, "seed": 11}
    status, got = generate(server, body)
    assert status == 200, got
    assert_matches(got, reference(llm, body["text_input"], 20, 0.8, 11), llm)
    status, got = generate(server, {"input_ids": [7, 300, 12], "max_tokens": 9})       # greedy, ids in
    assert status == 200, got
    assert as_list(got["output_ids"]) == llm.generate([7, 300, 12], SamplingParams(max_new_tokens=9))[0].output_ids


def test_grpc_stream_concatenates_to_the_non_streaming_result(install, server, llm):
    body = {"text_input": "abc ghij kl", "max_tokens": 20, "temperature": 0.8, "seed": 11}
    status, whole = generate(server, body)
    assert status == 200
    (chunks,) = client_stream(install, server, {**body, "stream": True})
    assert len(chunks) >= 2 and not any("error" in c for c in chunks)
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text_output"] for c in chunks) == whole["text_output"]
    assert [c["finish_reason"] for c in chunks] == [""] * (len(chunks) - 1) + ["length"]
    assert [c["rounds"] for c in chunks] == sorted(c["rounds"] for c in chunks)        # in order
    assert chunks[-1]["tau"] == pytest.approx(whole["tau"])


def test_concurrent_clients_get_their_own_answers(server, llm, capsys):
    clients, per_client = 16, 8
    jobs = [[{"text_input": f"kl ab {c} cd {i}", "max_tokens": 6 + (c + i) % 11,
              "temperature": 0.0 if (c + i) % 3 == 0 else 0.9, "seed": 1000 * c + i}
             for i in range(per_client)] for c in range(clients)]
    results: dict[tuple[int, int], tuple[int, dict]] = {}

    def run(c):
        for i, body in enumerate(jobs[c]):
            results[c, i] = generate(server, body, timeout=120)
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    dt = time.perf_counter() - t0
    n = clients * per_client
    report(capsys, f"{clients} clients x {per_client} requests: {n} in {dt:.2f} s = {n / dt:.1f} requests/s")
    assert len(results) == n
    flat = [b for job in jobs for b in job]
    want = llm.generate([b["text_input"] for b in flat],
                        [SamplingParams(temperature=b["temperature"], max_new_tokens=b["max_tokens"], seed=b["seed"])
                         for b in flat])
    for (c, i), w in zip(((c, i) for c in range(clients) for i in range(per_client)), want):
        status, got = results[c, i]
        assert status == 200, got
        assert_matches(got, w, llm)


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 4}, "missing input"),
    ({"text_input": "ab", "max_tokens": "four"}, "'max_tokens' must be an integer"),   # the gateway's check
    ({"text_input": "ab", "temperature": "hot"}, "'temperature' must be a number"),
    ({"text_input": "ab", "max_tokens": 99999999999}, "'max_tokens' = 99999999999 is out of range"),
    ({"text_input": "ab", "max_tokens": 1 << 20}, "max_tokens (1048576)"),
    ({"text_input": "ab", "max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"input_ids": list(range(MAX_SEQ_LEN + 5)), "max_tokens": 4}, "exceeds max_seq_len"),
    ({"input_ids": [1, 2], "text_input": "ab"}, "not both"),
])
def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, llm, body, message):
    status, got = generate(server, body)
    assert status == 400 and message in got["error"], got
    status, got = generate(server, {"input_ids": [5, 6], "max_tokens": 3, "seed": 1, "temperature": 1.0})
    assert status == 200
    assert as_list(got["output_ids"]) == llm.generate(
        [5, 6], SamplingParams(temperature=1.0, max_new_tokens=3, seed=1))[0].output_ids


def test_stream_error_response(install, server):
    (resp,) = client_stream(install, server, {"input_ids": list(range(MAX_SEQ_LEN)), "stream": True})
    assert len(resp) == 1 and "exceeds max_seq_len" in resp[0]["error"]


def test_custom_metrics(server):
    before = metrics(server)
    status, got = generate(server, {"input_ids": [9, 9, 9], "max_tokens": 11, "seed": 4})
    assert status == 200
    after = metrics(server)
    key = '{{model="{}",version="1"}}'.format(MODEL)
    delta = lambda name: after[name + key] - before.get(name + key, 0.0)  # noqa: E731
    assert delta("dspark_generated_tokens_total") == 11
    assert delta("dspark_spec_rounds_total") == got["rounds"]
    assert 1.0 <= after["dspark_mean_accepted_length" + key] <= 5.0     # tau in [1, N + 1], N = 4
    assert after[f'nv_inference_request_success{key}'] > before.get(f'nv_inference_request_success{key}', 0)


def test_grpc_cancellation_frees_the_request(install, server):
    key = '{{model="{}",outcome="cancelled",version="1"}}'.format(MODEL)
    before = metrics(server).get("dspark_requests_total" + key, 0.0)
    (chunks,) = client_stream(install, server, {"input_ids": [3, 1, 4], "max_tokens": MAX_SEQ_LEN - 8,
                                                "stream": True}, cancel_after=1)
    assert 1 <= len(chunks) and chunks[0]["finish_reason"] == ""
    deadline = time.monotonic() + 20
    while metrics(server).get("dspark_requests_total" + key, 0.0) < before + 1:
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.2)
    status, _ = generate(server, {"input_ids": [1], "max_tokens": 2})
    assert status == 200


def test_one_token_answer_is_a_list(server):
    status, got = generate(server, {"input_ids": [4, 2], "max_tokens": 1})
    assert status == 200 and isinstance(got["output_ids"], list) and len(got["output_ids"]) == 1


def test_clean_shutdown(server):
    """Last test of the module: SIGTERM to our pid, exit 0, Triton removed its shm regions itself."""
    pid, regions = server.triton.proc.pid, set(server.triton._shm)
    assert regions, "the python backend's shm regions were not seen"
    t0 = time.monotonic()
    assert server.stop() == 0
    assert time.monotonic() - t0 < 8
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert server.triton.leaked == []
    assert not any(Path(r).exists() for r in regions)
