"""The supervisor's decisions without tritonserver: a stand-in server whose probe endpoint can
answer, fail or hang, and whose process can exit; the supervisor must restart it, report why,
refuse new work meanwhile (health), and give up after too many restarts or a failed restart.
The same paths against a real tritonserver are in test_serving_faults.py."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from dspark_trt.serving.probe import PROBE_PARAMETER, probe_model
from dspark_trt.serving.supervisor import Supervisor

from tests.support.http_stub import send_json, serve_in_thread


class ProbeEndpoint:
    """Answers /v2/models/m/generate as ``mode`` says: "ok", "error" or "hang"."""

    def __init__(self):
        self.mode, self.bodies, self.release = "ok", [], threading.Event()
        ep = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                ep.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if ep.mode == "hang":
                    ep.release.wait(30)
                    return
                ok = ep.mode == "ok"
                status, body = (200, {"output_ids": [7]}) if ok else (400, {"error": "Stub is not healthy"})
                send_json(self, status, body)

        self.httpd = serve_in_thread(Handler)
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]


class FakeProc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeServer:
    """What the supervisor uses of TritonServer; start() makes a healthy server again."""

    def __init__(self, endpoint: ProbeEndpoint):
        self.endpoint, self.http_url = endpoint, endpoint.url
        self.proc, self.dead, self.kills, self.starts = FakeProc(), [], 0, 0
        self.fail_start = False

    def dead_stubs(self):
        return self.dead

    def kill(self):
        self.kills += 1
        self.proc = None

    def start(self, timeout, abort=None):
        self.starts += 1
        if self.fail_start:
            raise RuntimeError("tritonserver exited with 1 before it was ready")
        self.proc, self.dead, self.endpoint.mode = FakeProc(), [], "ok"
        self.endpoint.release.set()
        return 0.01


@pytest.fixture
def endpoint():
    ep = ProbeEndpoint()
    yield ep
    ep.release.set()
    ep.httpd.shutdown()
    ep.httpd.server_close()


def supervise(server, **kw):
    lines = []
    sup = Supervisor(server, "m", interval=0.1, poll=0.05, probe_timeout=kw.pop("probe_timeout", 1.0),
                     report=lines.append, **kw)
    return sup.start(), lines


def wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_probe_is_one_real_token_request_marked_as_probe(endpoint):
    assert probe_model(endpoint.url, "m", 5).ok
    assert endpoint.bodies == [{"input_ids": [0], "max_tokens": 1, PROBE_PARAMETER: True}]
    endpoint.mode = "error"
    r = probe_model(endpoint.url, "m", 5)
    assert not r.ok and not r.timed_out and "not healthy" in r.detail
    endpoint.mode = "hang"
    r = probe_model(endpoint.url, "m", 0.3)
    assert r.timed_out
    assert not probe_model("http://127.0.0.1:9", "m", 1).ok          # nothing listens there


def test_healthy_server_is_left_alone(endpoint):
    server = FakeServer(endpoint)
    sup, lines = supervise(server)
    wait_for(lambda: len(endpoint.bodies) >= 5)
    sup.stop()
    assert server.kills == 0 and lines == [] and sup.health() == (True, "")


@pytest.mark.parametrize("fault, reason", [
    ("hang", "did not answer a 1-token request within 1 s"),
    ("error", "failed 2 probe requests in a row: HTTP 400: Stub is not healthy"),
    ("exit", "tritonserver exited with -11"),
    ("stub", "model worker process (python-backend stub, pid 4242) died"),
])
def test_fault_is_restarted_with_the_reason(endpoint, fault, reason):
    server = FakeServer(endpoint)
    seen = []

    def start(timeout, abort=None, _start=server.start):
        seen.append(sup.health())                        # what clients are told during the restart
        return _start(timeout, abort)
    server.start = start
    sup, lines = supervise(server)
    wait_for(lambda: len(endpoint.bodies) >= 1)
    if fault == "exit":
        server.proc.returncode = -11
    elif fault == "stub":
        server.dead = [4242]
    else:
        endpoint.mode = fault
    took = wait_for(lambda: server.starts == 1)
    wait_for(lambda: sup.health()[0])
    sup.stop()
    assert took < 5 and server.kills == 1
    assert seen == [(False, seen[0][1])] and reason in seen[0][1]
    assert reason in lines[0] and "ready again" in lines[1]


def test_gives_up_after_too_many_restarts(endpoint):
    server = FakeServer(endpoint)
    sup, lines = supervise(server, max_restarts=2)
    for _ in range(3):
        starts = server.starts
        wait_for(lambda: server.proc is not None)
        server.proc.returncode = 1
        wait_for(lambda: server.starts > starts or sup.failed.is_set())
    wait_for(sup.failed.is_set)
    sup.stop()
    assert server.starts == 2 and not sup.health()[0]
    assert "not restarting again (2 restarts within 600 s)" in sup.reason


def test_gives_up_when_the_restart_fails(endpoint):
    server = FakeServer(endpoint)
    server.fail_start = True
    sup, lines = supervise(server)
    server.proc.returncode = -6
    wait_for(sup.failed.is_set)
    sup.stop()
    assert "the restart failed: tritonserver exited with 1" in sup.reason and "error" in lines[-1]


def test_an_unexpected_error_in_the_supervisor_gives_up_instead_of_dying_silently(endpoint):
    """E.g. an OSError while killing or starting tritonserver: the watch ends with ``failed`` set
    (``serve`` exits with the reason), never a dead thread behind a gateway answering 503."""
    server = FakeServer(endpoint)

    def kill():
        raise OSError(28, "No space left on device")
    server.kill = kill
    sup, lines = supervise(server)
    server.proc.returncode = -9
    wait_for(sup.failed.is_set)
    sup.stop()
    assert "No space left on device" in sup.reason and not sup.thread.is_alive()
