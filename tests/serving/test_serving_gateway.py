"""The HTTP gateway without tritonserver: body checks, size limit, list outputs, upstream failures.

The upstream is a small stdlib HTTP server standing in for Triton's HTTP port; it records what
reaches it, so the tests can assert that a refused body never does. The real-server behaviour
(the same checks against tritonserver 2.51, the crash they prevent) is in test_serving_faults.py.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from dspark_trt.serving.gateway import HttpGateway
from dspark_trt.serving.generate_body import INPUTS, BadRequest, check_generate_body
from dspark_trt.serving.repository import TEMPLATES

from tests.support.http_stub import send_json, serve_in_thread


# ---- the body check --------------------------------------------------------------------------------

def test_inputs_mirror_the_config_template():
    text = (TEMPLATES / "config.pbtxt").read_text()
    block = re.search(r"input \[(.*?)\n\]", text, re.S).group(1)
    declared = re.findall(r'name: "(\w+)" data_type: (TYPE_\w+) dims: \[ (-?1) \]', block)
    assert {n: (t, d) for n, t, d in declared} == INPUTS


@pytest.mark.parametrize("body, message", [
    (b"not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"input_ids": [1], "max_tokens": NaN}', "not a JSON number"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"input_ids": [1], "junk": 1}', "unknown field 'junk'"),
    (b'{"input_ids": [1], "max_tokens": "four"}', "'max_tokens' must be an integer, got a string"),
    (b'{"input_ids": [1], "max_tokens": 99999999999}', "'max_tokens' = 99999999999 is out of range"),
    (b'{"input_ids": [1], "max_tokens": 1e30}', "'max_tokens' must be an integer, got a number"),
    (b'{"input_ids": [1], "max_tokens": true}', "'max_tokens' must be an integer, got a boolean"),
    (b'{"input_ids": [1], "max_tokens": [1, 2]}', "'max_tokens' must be a single value"),
    (b'{"input_ids": [1, 4294967297]}', "'input_ids' = 4294967297 is out of range"),
    (b'{"input_ids": "abc"}', "'input_ids' must be an integer, got a string"),
    (b'{"input_ids": [1], "seed": -1}', "'seed' = -1 is out of range"),
    (b'{"input_ids": [1], "temperature": "hot"}', "'temperature' must be a number"),
    (b'{"input_ids": [1], "temperature": 1e39}', "out of the FP32 range"),
    (b'{"text_input": 5}', "'text_input' must be a string"),
    (b'{"text_input": "a", "stream": 1}', "'stream' must be true or false"),
    (b'{"text_input": "a", "stop": ["x", 3]}', "'stop' must be a string"),
    (b'{"text_input": "a", "stream": true}', "needs the /generate_stream endpoint"),
    (b'{"text_input": "a", "parameters": 3}', "'parameters' must be an object"),
])
def test_bad_bodies_are_named(body, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        check_generate_body(body, stream_endpoint=False)


def test_good_bodies_pass():
    body = {"text_input": "ab", "max_tokens": 2**31 - 1, "temperature": 0.5, "top_p": 1, "seed": 2**64 - 1,
            "stop": ["x"], "stop_ids": 3, "id": "r1", "parameters": {"k": 1}}
    assert check_generate_body(json.dumps(body).encode(), stream_endpoint=False) == body
    assert check_generate_body(b'{"input_ids": [0, 1], "stream": true, "max_tokens": [4]}', True)["stream"]


# ---- the gateway over a recording upstream ----------------------------------------------------------

class Upstream:
    """Stands in for Triton's HTTP: records requests; canned answers per path."""

    def __init__(self):
        self.seen: list[tuple[str, str, str, bytes]] = []     # method, path, content type, body
        self.hold = threading.Event()                          # /hang waits on it
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                self.do_POST()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                up.seen.append((self.command, self.path, self.headers.get("Content-Type", ""), body))
                if self.path.endswith("/hang"):
                    up.hold.wait(30)
                    self.close_connection = True               # no answer, then closed: like a killed server
                    return
                if self.path.endswith("/generate_stream"):
                    events = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in (
                        {"output_ids": 5, "acceptance_per_position": 0.5},
                        {"output_ids": [6, 7], "acceptance_per_position": [0.5]}))
                    broken = "broken" in body.decode()            # dies before the announced end
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", str(len(events) + (1000 if broken else 0)))
                    self.end_headers()
                    self.wfile.write(events)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                send_json(self, 200, {"output_ids": 297, "acceptance_per_position": 0.25, "text_output": "é"},
                          "application/json")

        self.httpd = serve_in_thread(Handler)

    @property
    def address(self) -> str:
        return "%s:%d" % self.httpd.server_address[:2]


@pytest.fixture
def upstream():
    up = Upstream()
    yield up
    up.hold.set()
    up.httpd.shutdown()
    up.httpd.server_close()


@pytest.fixture
def health():
    return {"state": (True, "")}


@pytest.fixture
def gateway(upstream, health):
    g = HttpGateway(upstream.address, max_request_bytes=1000, health=lambda: health["state"],
                    client_timeout=10, upstream_timeout=10).start()
    yield g
    g.stop()


def request(gateway, method, path, body=None, headers=None, timeout=20):
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


GEN = "/v2/models/dspark/generate"


def test_generate_is_forwarded_as_json_with_list_outputs(gateway, upstream):
    body = b'{"input_ids": [1, 2], "max_tokens": 1}'
    status, data = request(gateway, "POST", GEN, body, {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200
    assert json.loads(data) == {"output_ids": [297], "acceptance_per_position": [0.25], "text_output": "é"}
    assert upstream.seen == [("POST", GEN, "application/json", body)]     # never a form for evhtp


def test_stream_events_get_list_outputs(gateway):
    status, data = request(gateway, "POST", GEN + "_stream", b'{"input_ids": [1], "stream": true}')
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n") if line]
    assert events == [{"output_ids": [5], "acceptance_per_position": [0.5]},
                      {"output_ids": [6, 7], "acceptance_per_position": [0.5]}]


def test_a_stream_cut_by_the_server_ends_with_an_error_event(gateway):
    status, data = request(gateway, "POST", GEN + "_stream", b'{"input_ids": [1], "text_input": "broken"}')
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n") if line]
    assert events[:2] == [{"output_ids": [5], "acceptance_per_position": [0.5]},
                          {"output_ids": [6, 7], "acceptance_per_position": [0.5]}]
    assert "failed while handling this request" in events[-1]["error"]


def test_bad_json_is_400_and_never_forwarded(gateway, upstream):
    status, data = request(gateway, "POST", GEN, b'{"input_ids": [1], "max_tokens": 99999999999}')
    assert status == 400 and "'max_tokens'" in json.loads(data)["error"]
    assert upstream.seen == []


def test_oversized_and_chunked_bodies_are_refused_before_forwarding(gateway, upstream):
    status, data = request(gateway, "POST", GEN, b"x" * 5000)
    assert status == 413 and "over the limit of 1000 bytes" in json.loads(data)["error"]
    status, data = request(gateway, "POST", "/v2/models/dspark/infer", iter([b"x" * 10]),
                           {"Transfer-Encoding": "chunked"})
    assert status == 411
    assert upstream.seen == []
    assert request(gateway, "GET", "/v2/health/ready")[0] == 200        # the gateway still serves


def test_expect_100_continue_with_an_oversized_body_is_refused_before_the_upload(gateway, upstream):
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n"
                  b"Expect: 100-continue\r\n\r\n")                       # and no body
        reply = http.client.HTTPResponse(s)                               # the answer comes at once
        reply.begin()
        assert reply.status == 413 and b"over the limit" in reply.read()
    assert upstream.seen == []


def test_compressed_generate_body_is_refused(gateway, upstream):
    status, data = request(gateway, "POST", GEN, b"\x1f\x8b junk", {"Content-Encoding": "gzip"})
    assert status == 415 and upstream.seen == []


def test_unavailable_model_gets_503_with_the_reason(gateway, upstream, health):
    health["state"] = (False, "the model worker process died")
    status, data = request(gateway, "POST", GEN, b'{"input_ids": [1]}')
    assert status == 503 and "worker process died" in json.loads(data)["error"]
    assert request(gateway, "GET", "/v2/health/ready")[0] == 503
    assert upstream.seen == []


def test_upstream_dropping_a_request_gives_503_not_a_hang(gateway, upstream):
    result = {}
    t = threading.Thread(target=lambda: result.update(r=request(gateway, "POST", "/v2/models/dspark/hang", b"{}")))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()                                  # waiting on the upstream
    t0 = time.monotonic()
    upstream.hold.set()                                  # the upstream drops the connection
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    status, data = result["r"]
    assert status == 503 and "failed while handling this request" in json.loads(data)["error"]


def test_a_stalled_client_times_out_and_others_are_served(upstream):
    g = HttpGateway(upstream.address, client_timeout=1).start()
    try:
        host, port = g.url.removeprefix("http://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        stalled.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")   # never finishes
        assert request(g, "POST", GEN, b'{"input_ids": [1]}')[0] == 200
        stalled.settimeout(5)
        assert stalled.recv(100) == b""                  # the gateway gave up on it after 1 s
        stalled.close()
    finally:
        g.stop()
