"""The streaming gRPC client when the stream breaks while it is still sending (a fake tritonclient)."""
from __future__ import annotations

import sys
import types

from dspark_trt.serving import client


class _StreamBroken(Exception):
    pass


class _Error:
    """A gRPC-status error as tritonclient's stream callback reports it."""
    def status(self):
        return "StatusCode.UNAVAILABLE"

    def __str__(self):
        return "Socket closed"


class _Client:
    """Accepts the first request, then the stream dies: the callback gets the broken stream's
    error and every later send raises, as tritonclient does after a server is killed."""
    def __init__(self, url):
        self.sent = 0

    def start_stream(self, callback):
        self.callback = callback

    def async_stream_infer(self, model, inputs, request_id, outputs, enable_empty_final_response):
        if self.sent:
            raise _StreamBroken("A new stream should be started after stopping the current stream.")
        self.sent += 1
        self.callback(None, _Error())

    def stop_stream(self, cancel_requests=False):
        pass

    def close(self):
        pass


def test_a_stream_broken_while_sending_fails_every_request_without_raising(monkeypatch):
    grpc = types.SimpleNamespace(InferenceServerClient=_Client, InferRequestedOutput=lambda name: name,
                                 InferInput=lambda *a: types.SimpleNamespace(set_data_from_numpy=lambda arr: None))
    pkg = types.ModuleType("tritonclient")
    monkeypatch.setitem(sys.modules, "tritonclient", pkg)
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", grpc)
    monkeypatch.setitem(sys.modules, "tritonclient.utils", types.SimpleNamespace(InferenceServerException=_StreamBroken))
    pkg.grpc, pkg.utils = grpc, sys.modules["tritonclient.utils"]
    got = client.stream("127.0.0.1:1", "dspark", [{"input_ids": [1]}, {"input_ids": [2]}, {"input_ids": [3]}],
                        timeout=5.0)
    assert [len(r) for r in got] == [1, 1, 1]
    assert all(r[0]["client_error"] and "the stream failed" in r[0]["error"] for r in got), got
    assert "Socket closed" in got[0][0]["error"] and "new stream" in got[2][0]["error"]
