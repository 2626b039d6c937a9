"""Fault injection on a real `dspark-trt serve --triton` (tritonserver 2.51 from the serving venv, CPU).

One `serve` process for the module (the faults allow it: each leaves the server serving again),
in this order: an oversized body, a client that stops reading its stream, kill -9 of the model
worker (the python-backend stub) with requests in flight, a hung worker (SIGSTOP) that only the
real probe can see, a silent tritonserver (SIGSTOP: client.py must give up, the probe's timeout
must restart it), and last SIGTERM of `serve` under load. Every step asserts a bound on time:
nothing may hang. Needs the serving venv (scripts/setup_triton_env.sh; CI creates it).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dspark_trt.serving.server import STUB_NAME, ServingEnvError, TritonInstall, descendants

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "dspark_trt" / "serving" / "client.py"
MODEL = "dspark"
MAX_SEQ_LEN = 4096
LONG = MAX_SEQ_LEN - 8                   # max_tokens that keep a request busy for seconds
PROBE_TIMEOUT = 6                        # serve --probe-timeout: how long a hung model may stay silent
ERROR_BOUND = 30                         # every in-flight client hears an error within this
RECOVERY_BOUND = 60                      # ... and the server is ready again within this


class Serve:
    """A `dspark-trt serve --triton` subprocess; its stdout/stderr go to files (no pipe to fill)."""

    def __init__(self, tmp: Path, install: TritonInstall):
        self.install, self.tmp = install, tmp
        self.out, self.err = tmp / "serve.out", tmp / "serve.err"
        cmd = [sys.executable, "-m", "dspark_trt.cli", "serve", "--triton", "--model", "qwen3-tiny-dspark",
               "--random-weights", "--device", "cpu", "--dtype", "fp32", "--max-batch-size", "8",
               "--max-seq-len", str(MAX_SEQ_LEN), "--cpu-threads", "1", "--default-max-tokens", "8",
               "--output", str(tmp / "model_repository"), "--probe-interval", "1",
               "--probe-timeout", str(PROBE_TIMEOUT), "--ready-timeout", "120"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DSPARK_TRITON_ENV": str(install.env),
               "OMP_NUM_THREADS": "1"}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        self.http_url = self.grpc_url = self.metrics_url = ""

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while "ready in" not in self.out.read_text():
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.logs()}"
            assert time.monotonic() - t0 < timeout, f"serve not ready in {timeout} s:\n{self.logs()}"
            time.sleep(0.2)
        time.sleep(0.2)                                  # the address lines follow the ready line
        for line in self.out.read_text().splitlines():
            words = line.split()
            if words[:1] == ["HTTP"]:
                self.http_url = words[1]
            elif words[:1] == ["gRPC"]:
                self.grpc_url = words[1]
            elif words[:1] == ["metrics"]:
                self.metrics_url = words[1]
        assert self.http_url and self.grpc_url, self.logs()
        return time.monotonic() - t0

    def tritonserver(self) -> int:
        (pid,) = [p for p in descendants(self.proc.pid) if _comm(p) == "tritonserver"]
        return pid

    def stubs(self) -> list[int]:
        return [p for p in descendants(self.tritonserver()) if _is_stub(p)]

    def logs(self) -> str:
        log = self.tmp / "tritonserver.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
        return f"--- serve stdout\n{self.out.read_text()}\n--- serve stderr\n{self.err.read_text()}\n--- log\n{tail}"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _is_stub(pid: int) -> bool:
    comm = _comm(pid)                                    # the kernel keeps 15 characters of the name
    return bool(comm) and STUB_NAME.startswith(comm)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _shm_files(pids: list[int]) -> set[str]:
    found = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                found.add(parts[5].removesuffix(" (deleted)"))
    return found


@pytest.fixture(scope="module")
def install():
    try:
        return TritonInstall.find()
    except ServingEnvError as e:
        pytest.skip(f"serving venv unavailable (CI creates it with scripts/setup_triton_env.sh): {e}")


@pytest.fixture(scope="module")
def serve(install, tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("serve"), install)
    try:
        s.wait_ready(150)
        yield s
    finally:
        if s.proc.poll() is None:                        # a test failed before the SIGTERM test
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(20)
            except subprocess.TimeoutExpired:
                s.proc.kill()


# ---- clients ----------------------------------------------------------------------------------------

def http_post(url: str, path: str, body: bytes, content_type: str = "application/json",
              timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate(serve: Serve, body: dict, timeout: float = 60) -> tuple[int, dict]:
    return http_post(serve.http_url, f"/v2/models/{MODEL}/generate", json.dumps(body).encode(), timeout=timeout)


def cancelled_requests(serve: Serve) -> float:
    """dspark_requests_total{outcome="cancelled"} (the model drops a request its client left)."""
    with urllib.request.urlopen(serve.metrics_url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dspark_requests_total{") and 'outcome="cancelled"' in line:
                return float(line.split()[-1])
    return 0.0


def ready(serve: Serve) -> int:
    try:
        with urllib.request.urlopen(serve.http_url + "/v2/health/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class SseClient(threading.Thread):
    """POST /generate_stream and collect the events; ``first`` is set at the first one."""

    def __init__(self, serve: Serve, body: dict, timeout: float = 90):
        super().__init__(daemon=True)
        self.url, self.body, self.timeout = serve.http_url, body, timeout
        self.events: list[dict] = []
        self.first = threading.Event()
        self.failure: str | None = None
        self.ended_at: float | None = None

    def run(self):
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
        try:
            conn.request("POST", f"/v2/models/{MODEL}/generate_stream", json.dumps(self.body).encode(),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.events.append(json.loads(resp.read()))
                return
            for line in resp:
                if line.startswith(b"data:"):
                    self.events.append(json.loads(line[5:]))
                    self.first.set()
        except (OSError, http.client.HTTPException) as e:
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
            conn.close()


class HttpClient(threading.Thread):
    def __init__(self, serve: Serve, body: dict, timeout: float = 90):
        super().__init__(daemon=True)
        self.serve, self.body, self.timeout = serve, body, timeout
        self.result: tuple[int, dict] | None = None
        self.failure: str | None = None
        self.ended_at: float | None = None

    def run(self):
        try:
            self.result = generate(self.serve, self.body, self.timeout)
        except (OSError, http.client.HTTPException) as e:
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()


def grpc_client(serve: Serve, request: dict, timeout: float = 90) -> subprocess.Popen:
    """client.py in the serving venv, one streaming request; read it with ``grpc_result``."""
    return subprocess.Popen([str(serve.install.python), str(CLIENT), "--url", serve.grpc_url, "--model", MODEL,
                             "--request", json.dumps(request), "--timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def grpc_result(proc: subprocess.Popen, timeout: float) -> tuple[int, list[dict]]:
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, lines or [{"stderr": err[-2000:]}]


def assert_serves(serve: Serve) -> None:
    status, got = generate(serve, {"input_ids": [3, 1, 4], "max_tokens": 5}, timeout=30)
    assert status == 200 and len(got["output_ids"]) == 5, got
    rc, lines = grpc_result(grpc_client(serve, {"input_ids": [2, 7], "max_tokens": 3, "stream": True}, 30), 60)
    assert rc == 0 and sum(len(d["output_ids"]) for d in lines) == 3, lines


# ---- the faults ---------------------------------------------------------------------------------

def test_oversized_body_is_refused_and_the_server_stays_up(serve):
    """A 5 MB body (form-encoded: what crashed tritonserver 2.51) gets 413; Triton never sees it."""
    triton = serve.tritonserver()
    junk = b'{"input_ids": [1], "junk": "' + b"a" * (5 << 20) + b'"}'
    t0 = time.monotonic()
    for path, ctype in ((f"/v2/models/{MODEL}/generate", "application/x-www-form-urlencoded"),
                        (f"/v2/models/{MODEL}/infer", "application/x-www-form-urlencoded"),
                        (f"/v2/models/{MODEL}/generate", "text/plain")):
        status, got = http_post(serve.http_url, path, junk, ctype, timeout=30)
        assert status == 413 and "over the limit" in got["error"], got
    # a body under the limit but too long a prompt: the model's 400, naming max_seq_len
    status, got = generate(serve, {"input_ids": [5] * 100_000, "max_tokens": 1})
    assert status == 400 and "exceeds max_seq_len" in got["error"], got
    assert time.monotonic() - t0 < 30
    assert ready(serve) == 200 and serve.tritonserver() == triton        # no crash, no restart
    assert_serves(serve)


def test_client_that_stops_reading_a_stream_does_not_block_others(serve):
    """Three clients start long streams and never read them; others are served meanwhile; when
    the three hang up, their requests are cancelled (batch slots and KV pages freed)."""
    cancelled_before = cancelled_requests(serve)
    host, port = serve.http_url.removeprefix("http://").rsplit(":", 1)
    stalled = []
    for _ in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # fills at once: the gateway blocks
        s.connect((host, int(port)))
        body = json.dumps({"input_ids": [1, 2, 3], "max_tokens": LONG, "stream": True}).encode()
        conn = http.client.HTTPConnection(host, int(port))
        conn.sock = s
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body, {"Content-Type": "application/json"})
        stalled.append(conn)                                          # ... and never read
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        clients = [HttpClient(serve, {"input_ids": [i + 1, 5], "max_tokens": 6}) for i in range(4)]
        clients += [SseClient(serve, {"input_ids": [9, i + 1], "max_tokens": 6, "stream": True}) for i in range(2)]
        for c in clients:
            c.start()
        grpc = grpc_result(grpc_client(serve, {"input_ids": [4, 4], "max_tokens": 6, "stream": True}, 60), 90)
        for c in clients:
            c.join(60)
        assert time.monotonic() - t0 < 60
        for c in clients[:4]:
            assert c.result and c.result[0] == 200 and len(c.result[1]["output_ids"]) == 6, (c.result, c.failure)
        for c in clients[4:]:
            assert c.failure is None and sum(len(e["output_ids"]) for e in c.events) == 6, c.events
        assert grpc[0] == 0 and sum(len(d["output_ids"]) for d in grpc[1]) == 6, grpc
    finally:
        for conn in stalled:
            conn.close()
    t0 = time.monotonic()
    while cancelled_requests(serve) < cancelled_before + len(stalled):
        assert time.monotonic() - t0 < 20, "the abandoned streams were not cancelled"
        time.sleep(0.2)


def _in_flight(serve: Serve):
    """Six long requests in flight: 2 gRPC streams, 2 SSE streams, 2 HTTP /generate."""
    body = {"input_ids": [1, 2, 3], "max_tokens": LONG}
    grpc = [grpc_client(serve, {**body, "input_ids": [i + 1, 2], "stream": True}, timeout=120) for i in range(2)]
    sse = [SseClient(serve, {**body, "input_ids": [i + 3, 2], "stream": True}, timeout=120) for i in range(2)]
    plain = [HttpClient(serve, {**body, "input_ids": [i + 5, 2]}, timeout=120) for i in range(2)]
    for c in (*sse, *plain):
        c.start()
    for c in sse:
        assert c.first.wait(30) and c.events, "the stream did not start"
    time.sleep(0.5)
    return grpc, sse, plain


def _assert_all_failed_fast(grpc, sse, plain, t_fault: float) -> None:
    for c in (*sse, *plain):
        c.join(max(0.1, t_fault + ERROR_BOUND - time.monotonic()))
        assert not c.is_alive(), "an HTTP client still waits"
        assert c.ended_at - t_fault < ERROR_BOUND
    for c in sse:                     # the stream ends with an error event (or the connection drops)
        assert c.failure or "error" in c.events[-1], c.events[-3:]
    for c in plain:
        assert c.failure or (c.result[0] >= 400 and "error" in c.result[1]), c.result
    for p in grpc:        # the stream broke (exit 1), or the server failed the request first (exit 0)
        rc, lines = grpc_result(p, max(1.0, t_fault + ERROR_BOUND - time.monotonic()))
        assert "error" in lines[-1], (rc, lines[-3:])


def _wait_recovered(serve: Serve, old_triton: int, t_fault: float) -> float:
    while True:
        if ready(serve) == 200:
            try:
                if serve.tritonserver() != old_triton:
                    break
            except ValueError:                          # between the old server and the new one
                pass
        assert serve.proc.poll() is None, serve.logs()
        assert time.monotonic() - t_fault < RECOVERY_BOUND, f"not ready again:\n{serve.logs()}"
        time.sleep(0.2)
    return time.monotonic() - t_fault


def test_killed_worker_fails_in_flight_requests_and_is_restarted(serve, capsys):
    triton = serve.tritonserver()
    grpc, sse, plain = _in_flight(serve)
    (stub,) = serve.stubs()
    os.kill(stub, signal.SIGKILL)
    t_kill = time.monotonic()
    _assert_all_failed_fast(grpc, sse, plain, t_kill)
    failed_in = max(c.ended_at for c in (*sse, *plain)) - t_kill
    recovered_in = _wait_recovered(serve, triton, t_kill)
    restart = [line for line in serve.err.read_text().splitlines() if "restarting tritonserver" in line][-1]
    assert_serves(serve)
    with capsys.disabled():     # tritonserver itself sometimes aborts when its stub dies, sometimes not
        print(f"\n[faults] kill -9 stub: in-flight HTTP clients failed within {failed_in:.2f} s, "
              f"ready again after {recovered_in:.1f} s ({restart.split(';')[0]})")


def test_hung_worker_is_found_by_the_probe_and_restarted(serve, capsys):
    """SIGSTOP: the stub process is still there; only a real request can tell it does not answer
    (Triton answers "Stub process ... is not healthy" once its own stub health check times out)."""
    triton = serve.tritonserver()
    plain = [HttpClient(serve, {"input_ids": [8, 1], "max_tokens": LONG}, timeout=120)]
    plain[0].start()
    time.sleep(0.5)
    (stub,) = serve.stubs()
    os.kill(stub, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        _assert_all_failed_fast([], [], plain, t_stop)
        recovered_in = _wait_recovered(serve, triton, t_stop)
    finally:
        try:
            os.kill(stub, signal.SIGKILL)                # if the restart did not take it
        except ProcessLookupError:
            pass
    restart = [line for line in serve.err.read_text().splitlines() if "restarting tritonserver" in line][-1]
    assert "probe" in restart or "1-token request" in restart, restart      # not a process check
    assert_serves(serve)
    with capsys.disabled():
        print(f"\n[faults] SIGSTOP stub: ready again after {recovered_in:.1f} s ({restart.split(';')[0]})")


def test_silent_server_client_times_out_and_the_probe_restarts_it(serve, capsys):
    """SIGSTOP of tritonserver itself: nothing answers. client.py gives up after its --timeout
    (it used to block forever in stop_stream); the probe's timeout finds the hang; restart."""
    triton = serve.tritonserver()
    client = grpc_client(serve, {"input_ids": [6, 1], "max_tokens": LONG, "stream": True}, timeout=3)
    time.sleep(1.0)
    os.kill(triton, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        rc, lines = grpc_result(client, 3 + 5 + 5)       # --timeout, the bounded close, margin
        client_took = time.monotonic() - t_stop
        assert rc == 1 and "timed out" in lines[-1]["error"], lines[-3:]
        recovered_in = _wait_recovered(serve, triton, t_stop)
    finally:
        try:
            os.kill(triton, signal.SIGCONT)              # if the restart did not take it
        except ProcessLookupError:
            pass
    restart = [line for line in serve.err.read_text().splitlines() if "restarting tritonserver" in line][-1]
    assert f"did not answer a 1-token request within {PROBE_TIMEOUT} s" in restart, restart
    assert_serves(serve)
    with capsys.disabled():
        print(f"\n[faults] SIGSTOP tritonserver: client.py gave up after {client_took:.1f} s, "
              f"ready again after {recovered_in:.1f} s (probe timeout {PROBE_TIMEOUT} s)")


def test_sigterm_under_load_exits_quickly_and_leaves_nothing(serve, capsys):
    """Last: SIGTERM while requests run; serve exits 0 within 10 s, its processes and shm gone."""
    triton = serve.tritonserver()
    processes = [triton, *descendants(triton)]
    regions = _shm_files(processes)
    assert regions, "the python backend's shm regions were not seen"
    grpc, sse, plain = _in_flight(serve)
    serve.proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    rc = serve.proc.wait(20)
    took = time.monotonic() - t_term
    assert took < 10 and rc == 0, serve.logs()
    assert not any(_running(p) and (_comm(p) == "tritonserver" or _is_stub(p)) for p in processes), serve.logs()
    assert not any(Path(r).exists() for r in regions)
    for c in (*sse, *plain):                             # every client got an error, none hangs
        c.join(ERROR_BOUND)
        assert not c.is_alive() and c.ended_at - t_term < 10
    for c in sse:
        assert c.failure is None and "error" in c.events[-1], (c.failure, c.events[-2:])
    for c in plain:
        assert c.result and c.result[0] >= 400 and "error" in c.result[1], (c.failure, c.result)
    for p in grpc:
        rc, lines = grpc_result(p, ERROR_BOUND)
        assert "error" in lines[-1], (rc, lines[-3:])
    with capsys.disabled():
        print(f"\n[faults] SIGTERM under load: serve exited in {took:.1f} s")
