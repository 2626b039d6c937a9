"""The decoupled Triton python model: parse requests, feed the generation worker, send responses.

``pb_utils`` (triton_python_backend_utils) is passed in, so tests can use a fake one.
``execute`` only parses and enqueues (it returns at once); the worker thread streams responses
through each request's response sender. Non-streaming requests get exactly one response (what
HTTP ``/generate`` needs); streaming ones get one per round with new tokens, the last one flagged
final and carrying the finish reason.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from ..runtime.sampling_params import RequestError, SpecStats
from .probe import PROBE_PARAMETER
from .request import parse_request
from .source import ServedModel
from .worker import GenerationWorker

log = logging.getLogger(__name__)


class TritonSink:
    """Sends one request's responses through its decoupled response sender."""

    def __init__(self, pb, request):
        self.pb, self.request = pb, request
        self.sender = request.get_response_sender()

    def send(self, ids, text, final, finish_reason, stats: SpecStats) -> None:
        pb = self.pb
        out = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
               pb.Tensor("output_ids", np.asarray(ids, dtype=np.int32)),
               pb.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)),
               pb.Tensor("tau", np.array([stats.tau], dtype=np.float32)),
               pb.Tensor("acceptance_per_position",
                         np.asarray(stats.acceptance_per_position(), dtype=np.float32)),
               pb.Tensor("rounds", np.array([stats.rounds], dtype=np.int32))]
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb.InferenceResponse(output_tensors=out), flags=flags)

    def fail(self, message: str, cancelled: bool = False) -> None:
        pb = self.pb
        code = getattr(pb.TritonError, "CANCELLED", None) if cancelled else None
        err = pb.TritonError(message, code) if code is not None else pb.TritonError(message)
        self.sender.send(pb.InferenceResponse(output_tensors=[], error=err),
                         flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class Metrics:
    """Custom Prometheus metrics on Triton's /metrics (the families are kept referenced)."""

    def __init__(self, pb, labels: dict[str, str]):
        def fam(name, description, kind):
            return pb.MetricFamily(name=name, description=description, kind=kind)
        counter, gauge = pb.MetricFamily.COUNTER, pb.MetricFamily.GAUGE
        self.families = {
            "tokens": fam("dspark_generated_tokens_total", "Output tokens sent (finished requests)", counter),
            "rounds": fam("dspark_spec_rounds_total", "Draft-verify rounds run (finished requests)", counter),
            "accepted": fam("dspark_accepted_drafts_total", "Draft tokens accepted by the target", counter),
            "tau": fam("dspark_mean_accepted_length",
                       "Mean tokens committed per round (tau, bonus included) over finished requests", gauge),
            "requests": fam("dspark_requests_total", "Requests by outcome", counter),
        }
        self.tokens = self.families["tokens"].Metric(labels=labels)
        self.rounds = self.families["rounds"].Metric(labels=labels)
        self.accepted = self.families["accepted"].Metric(labels=labels)
        self.tau = self.families["tau"].Metric(labels=labels)
        self.outcomes = {o: self.families["requests"].Metric(labels={**labels, "outcome": o})
                         for o in ("success", "error", "cancelled")}
        self._rounds = self._committed = 0

    def on_finish(self, outcome: str, num_tokens: int, stats: SpecStats | None) -> None:
        self.outcomes[outcome].increment(1)
        if num_tokens:
            self.tokens.increment(num_tokens)
        if stats is not None and stats.rounds:
            self._rounds += stats.rounds
            self._committed += sum(stats.committed)
            self.rounds.increment(stats.rounds)
            self.accepted.increment(sum(stats.accepted))
            self.tau.set(self._committed / self._rounds)


def _is_probe(request) -> bool:
    """The supervisor's probe (probe.py) sets the request parameter ``dspark_probe``."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (AttributeError, TypeError, ValueError):
        return False
    return isinstance(params, dict) and params.get(PROBE_PARAMETER) is True


class DSparkModel:
    def __init__(self, pb, args: dict):
        self.pb = pb
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.source = ServedModel.from_parameters(params)
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))
        threads = int(params.get("cpu_threads", "0"))
        if threads > 0:
            import torch
            torch.set_num_threads(threads)
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.followers = []
        if self.source.tp_size > 1:          # this instance is rank 0 and starts the other ranks
            from ..parallel.launch import spawn_ranks
            self.followers, env = spawn_ranks(self.source.tp_size,
                                              ["-m", "dspark_trt.serving.tp_follower", json.dumps(params)])
            os.environ.update(env)
        self.llm = self.source.load(device)
        if self.followers:
            from ..parallel.replica import LeaderLLM
            self.llm = LeaderLLM(self.llm)
        self._warm_up()
        labels = {"model": config.get("name", args.get("model_name", "")),
                  "version": str(args.get("model_version", ""))}
        self.metrics = Metrics(pb, labels)
        self.worker = GenerationWorker(self.llm, self.source.speculative, self.metrics.on_finish).start()
        log.info("dspark model %s ready (%s)", labels["model"], args.get("model_instance_name", ""))

    def _warm_up(self) -> None:
        """One short request (prefill + a speculative round) so the first client pays no setup."""
        from ..runtime.sampling_params import SamplingParams
        n = min(self.llm.networks.num_spec_tokens + 2, self.llm.max_seq_len - 2)
        if n < 1:
            return
        gen = self.llm.scheduler(self.source.speculative)      # (under TP, every rank runs it)
        gen.add_request([0, 1], SamplingParams(max_new_tokens=n, seed=0, ignore_eos=True))
        while gen.has_work():
            gen.step()

    def execute(self, requests) -> None:
        tok = self.llm.tokenizer
        encode = (lambda s: tok.encode(s).ids) if tok is not None else None
        for request in requests:
            sink = TritonSink(self.pb, request)

            def get(name, request=request):
                t = self.pb.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()
            probe = _is_probe(request)
            try:
                req = parse_request(get, encode, self.default_max_tokens, self.llm.max_seq_len)
            except RequestError as e:
                sink.fail(str(e))
                if not probe:
                    self.metrics.on_finish("error", 0, None)
                continue
            req.probe = probe
            self.worker.submit(req, sink)
        return None

    def finalize(self) -> None:
        self.worker.shutdown()
        if self.followers:
            import torch.distributed as dist
            self.llm.stop()
            for p in self.followers:
                p.wait(timeout=60)
            dist.destroy_process_group()
