"""A fake Triton ``pb_utils`` (tensors, responses, metrics) and requests for the Triton model."""
from __future__ import annotations

import threading

import numpy as np


class FakePB:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, np.asarray(array)

        def as_numpy(self):
            return self.array

    class TritonError:
        CANCELLED = "CANCELLED"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.outputs = {t.name: t.as_numpy() for t in output_tensors}
            self.error = error

    class MetricFamily:
        COUNTER, GAUGE = "counter", "gauge"
        created: list = []

        def __init__(self, name, description, kind):
            self.name, self.kind, self.metrics = name, kind, []
            FakePB.MetricFamily.created.append(self)

        def Metric(self, labels):
            m = FakeMetric(labels)
            self.metrics.append(m)
            return m

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return FakePB.Tensor(name, request.inputs[name]) if name in request.inputs else None


class FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


class FakeRequest:
    def __init__(self, **inputs):
        self.inputs = inputs
        self.responses: list = []
        self.done = threading.Event()
        self.cancelled = False
        self.first = threading.Event()

    def get_response_sender(self):
        return self

    def send(self, response=None, flags=0):          # the sender interface
        assert not self.done.is_set(), "response after the final one"
        self.responses.append(response)
        self.first.set()
        if flags & FakePB.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def wait(self, timeout=60):
        assert self.done.wait(timeout), "no final response"
        return self.responses


def ids_request(ids, max_tokens, **kw):
    inputs = {"input_ids": np.asarray(ids, np.int32), "max_tokens": np.array([max_tokens], np.int32)}
    if "seed" in kw:
        inputs["seed"] = np.array([kw.pop("seed")], np.uint64)
    if "temperature" in kw:
        inputs["temperature"] = np.array([kw.pop("temperature")], np.float32)
    if "stream" in kw:
        inputs["stream"] = np.array([kw.pop("stream")])
    inputs.update(kw)
    return FakeRequest(**inputs)
