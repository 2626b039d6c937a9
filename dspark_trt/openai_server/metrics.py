"""Prometheus metrics of the OpenAI front end, named like vLLM's (prefix ``dspark:``).

Each app has its own ``CollectorRegistry`` (several servers can live in one process, as in tests).
Request-level values are recorded when a request ends (``record_finished``), from the same
``SpecStats`` snapshot its response's ``dspark`` field reports, so the spec-decode counters equal
the sums over the responses; so do the confidence-scheduling metrics (issue #25): the histogram of
tokens each request verified per round (its admitted drafts + the anchor row; N + 1 in the fixed
mode) and the acceptance of the admitted drafts (accepted / verified drafts, over all finished
requests, with its two counters). Gauges (running / waiting requests, KV pages in use) are set by the
engine thread after every step.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime.sampling_params import SpecStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
PREFIX = "dspark:"


class ServerMetrics:
    def __init__(self, model_name: str, num_spec_tokens: int):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self.num_spec_tokens = num_spec_tokens

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=r)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=r).labels(**label)
        self.label = label
        self.requests = counter("request_success", "Finished requests by finish reason",
                                ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(**label)
        self.generation_tokens = counter("generation_tokens",
                                         "Completion tokens of finished requests").labels(**label)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between token deliveries (one observation per delivered token)")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission")
        self.kv_pages_in_use = gauge("kv_cache_pages_in_use", "KV cache pages owned by sequences")
        self.kv_pages_total = gauge("kv_cache_pages_total", "KV cache pages in the pool")
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft-verify rounds").labels(**label)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens proposed to the verifier").labels(**label)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted and committed").labels(**label)
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted draft tokens by draft position", ("position",))
        for k in range(num_spec_tokens):                          # every position shows from the start
            self.spec_accepted_per_pos.labels(position=str(k), **label)
        self.spec_verified_per_round = Histogram(
            PREFIX + "spec_decode_verified_tokens_per_round",
            "Tokens a request verified in one draft-verify round (admitted drafts + 1)", ["model_name"],
            buckets=tuple(float(b) for b in range(1, num_spec_tokens + 2)), registry=r).labels(**label)
        self.spec_admitted = counter("spec_decode_num_admitted_tokens",
                                     "Draft tokens admitted to verification (= num_draft_tokens)").labels(**label)
        self.spec_admitted_acceptance = gauge(
            "spec_decode_admitted_acceptance_rate",
            "Accepted / admitted draft tokens over all finished requests (0 before any)")
        self._admitted, self._accepted = 0, 0
        self._lock = threading.Lock()             # requests finish on the server's threads

    def record_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        stats: SpecStats) -> None:
        self.requests.labels(finished_reason=finish_reason, **self.label).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.spec_drafts.inc(sum(1 for p in stats.proposed if p > 0))
        self.spec_draft_tokens.inc(sum(stats.proposed))
        self.spec_accepted.inc(sum(stats.accepted))
        for p in stats.proposed:
            self.spec_verified_per_round.observe(p + 1)
        self.spec_admitted.inc(sum(stats.proposed))
        with self._lock:
            self._admitted += sum(stats.proposed)
            self._accepted += sum(stats.accepted)
            self.spec_admitted_acceptance.set(self._accepted / self._admitted if self._admitted else 0.0)
        for k in range(stats.num_spec_tokens):
            count = sum(a > k for a in stats.accepted)
            if count:
                self.spec_accepted_per_pos.labels(position=str(k), **self.label).inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
