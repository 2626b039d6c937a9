"""One background thread that owns a ``Scheduler`` and batches every request of a model instance.

Requests arrive from any thread through ``submit`` (a thread-safe queue); between rounds the
thread admits them into the continuous batch, drops cancelled ones, runs one ``step`` and hands
each request's new tokens to its ``Sink``. A bad request fails alone; a failing round fails the
requests it was running and the worker carries on with a fresh scheduler.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..runtime.sampling_params import RequestError, SpecStats
from .detokenizer import IncrementalText
from .request import ServingRequest

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where one request's results go (a Triton response sender, or a test double)."""

    def send(self, ids: list[int], text: str, final: bool, finish_reason: str, stats: SpecStats) -> None: ...
    def fail(self, message: str, cancelled: bool = False) -> None: ...
    def is_cancelled(self) -> bool: ...


@dataclass
class _Active:
    req: ServingRequest
    sink: Sink
    text: IncrementalText | None
    seq: object = None                                  # runtime Sequence
    new_ids: list[int] = field(default_factory=list)    # committed since the last send
    ids: list[int] = field(default_factory=list)        # all kept ids
    text_out: str = ""                                  # all released text


# outcome in {"success", "error", "cancelled"}, output tokens, stats (None unless success)
FinishHook = Callable[[str, int, "SpecStats | None"], None]


class GenerationWorker:
    def __init__(self, llm, speculative: bool = True, on_finish: FinishHook | None = None):
        self.llm, self.speculative = llm, speculative
        self.gen = llm.scheduler(speculative)
        self.on_finish = on_finish or (lambda outcome, n, stats: None)
        self.inbox: queue.Queue = queue.Queue()
        self.active: dict[int, _Active] = {}
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dspark-generation", daemon=True)

    def start(self) -> "GenerationWorker":
        self.thread.start()
        return self

    def submit(self, req: ServingRequest, sink: Sink) -> None:
        if self._stopping.is_set():
            sink.fail("the model is shutting down")
            return
        self.inbox.put((req, sink))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still queued or running get an error response."""
        self._stopping.set()
        self.inbox.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.error("generation thread did not stop within %.0f s", timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._admit(block=not self.gen.has_work())
            self._drop_cancelled()
            if not self.gen.has_work():
                continue
            try:
                finished = self.gen.step()
            except Exception as e:                      # a bug or a device error: fail this batch only
                log.exception("generation round failed")
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                self.gen = self.llm.scheduler(self.speculative)
                continue
            self._emit({s.request_id for s in finished})
        self._fail_all("the model is shutting down")
        while True:                                     # whatever arrived after the loop ended
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._fail(item[0], item[1], "the model is shutting down")

    def _admit(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            req, sink = item
            act = _Active(req, sink, self._text_state(req))
            try:
                act.seq = self.gen.add_request(req.prompt_ids, req.params, on_tokens=act.new_ids.extend)
                self.active[act.seq.request_id] = act
            except RequestError as e:
                self._fail(req, sink, str(e))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _text_state(self, req: ServingRequest) -> IncrementalText | None:
        tok = self.llm.tokenizer
        if tok is None:
            return None
        return IncrementalText(lambda ids: tok.decode(ids, skip_special_tokens=True), req.stop)

    def _drop_cancelled(self) -> None:
        for rid, act in list(self.active.items()):
            try:
                cancelled = act.sink.is_cancelled()
            except Exception:                           # the sender is gone: treat as cancelled
                cancelled = True
            if cancelled:
                self.gen.abort(rid, "cancelled")
                del self.active[rid]
                self._fail(act.req, act.sink, "request cancelled", cancelled=True)

    def _emit(self, finished_ids: set[int]) -> None:
        for rid, act in list(self.active.items()):
            done = rid in finished_ids
            if not act.new_ids and not done:
                continue
            new, act.new_ids[:] = list(act.new_ids), []
            delta = ""
            if act.text is not None:
                delta, kept = act.text.push(new)
                if act.text.stopped and not done:       # a stop string ended the request
                    self.gen.abort(rid, "stop")
                    done = True
                new = new[:kept]
                if done:
                    delta += act.text.finish()
            act.ids += new
            act.text_out += delta
            if act.text is not None and act.text.stopped:
                act.seq.finish_reason = "stop"
            if done:
                del self.active[rid]
                self._finished(act.req, "success", len(act.ids), act.seq.stats)   # before the client hears
            if act.req.stream:
                sent = self._send(act, new, delta, done)
            else:
                sent = not done or self._send(act, act.ids, act.text_out, True)
            if not sent and not done:                   # the client is gone: stop generating
                self.gen.abort(rid, "error")
                del self.active[rid]
                self._finished(act.req, "error", len(act.ids), None)

    def _send(self, act: _Active, ids: list[int], text: str, final: bool) -> bool:
        reason = (act.seq.finish_reason or "") if final else ""
        try:
            act.sink.send(ids, text, final, reason, act.seq.stats)
            return True
        except Exception as e:                          # one broken client must not stop the loop
            log.warning("sending a response for request %d failed: %s", act.seq.request_id, e)
            return False

    def _fail_all(self, message: str) -> None:
        for rid, act in list(self.active.items()):
            self.gen.abort(rid, "error")
            self._fail(act.req, act.sink, message)
        self.active.clear()

    def _fail(self, req: ServingRequest, sink: Sink, message: str, cancelled: bool = False) -> None:
        try:
            sink.fail(message, cancelled=cancelled)
        except Exception as e:
            log.warning("sending an error response failed: %s", e)
        self._finished(req, "cancelled" if cancelled else "error", 0, None)

    def _finished(self, req: ServingRequest, outcome: str, num_tokens: int, stats: SpecStats | None) -> None:
        if not req.probe:                               # health probes stay out of the metrics
            self.on_finish(outcome, num_tokens, stats)
