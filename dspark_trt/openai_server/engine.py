"""The one background thread that owns the continuous-batching ``Scheduler``.

HTTP handlers (on the asyncio loop) call ``submit`` and ``abort``; both only enqueue a command.
The thread admits commands between steps, runs ``Scheduler.step`` while there is work, and
sends each request's events to its asyncio queue with ``loop.call_soon_threadsafe``:
``Admitted`` or ``Rejected`` first, then ``Tokens`` as rounds commit them, then ``Finished``
(with a copy of the sequence's ``SpecStats``). The scheduler is touched by this thread only.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..runtime.sampling_params import RequestError, SamplingParams, SpecStats

log = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.05


@dataclass
class Admitted:
    request_id: int


@dataclass
class Rejected:
    message: str


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list | None = None           # one ``runtime.logprobs.TokenLogprob`` per token, if asked


@dataclass
class Finished:
    finish_reason: str
    stats: SpecStats
    error: str | None = None


@dataclass
class RequestHandle:
    """One HTTP request's link to the engine: its events arrive on ``events``."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None          # set by the engine thread at admission
    abort_reason: str | None = None

    def push(self, event) -> None:
        """Thread-safe: deliver ``event`` on the handle's loop (dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                       # the event loop is closed (shutdown)
            pass


def copy_stats(stats: SpecStats) -> SpecStats:
    return SpecStats(stats.num_spec_tokens, list(stats.accepted), list(stats.committed),
                     list(stats.proposed))


class EngineThread:
    """Runs ``llm.scheduler()`` in a daemon thread; ``metrics`` (optional) gets its gauges set."""

    def __init__(self, llm, metrics=None, speculative: bool = True):
        self.llm, self.metrics, self.speculative = llm, metrics, speculative
        self.scheduler = llm.scheduler(speculative)
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}      # request_id -> handle, running or waiting
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.steps_run = 0

    # ---- called from the event loop --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def submit(self, handle: RequestHandle) -> None:
        if self._stopping.is_set():                    # stopped, or the thread failed: answer now
            handle.push(Rejected("the engine is not running"))
            return
        self._commands.put(("submit", handle))

    def abort(self, handle: RequestHandle, reason: str = "abort") -> None:
        """Drop the request (waiting or running) and free its KV pages, between two steps."""
        self._commands.put(("abort", handle, reason))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- read-only views (any thread; values may be one step old) -----------------------------
    def kv_pages_total(self) -> int:
        return self.scheduler.kv.num_pages

    def kv_pages_free(self) -> int:
        return len(self.scheduler.kv.free)

    def num_active(self) -> int:
        return len(self._handles)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.scheduler.has_work())
                if self.scheduler.has_work():
                    self._step()
                self._update_gauges()
        except Exception as e:                         # the thread ends: nobody may wait for it
            log.exception("the engine thread failed")
            reason = f"internal error in the engine: {type(e).__name__}: {e}"
        finally:
            self._stopping.set()
            for handle in list(self._handles.values()):
                handle.push(Finished("abort", SpecStats(), reason))
            self._handles.clear()
            while True:                                # requests queued but never admitted
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None and command[0] == "submit":
                    command[1].push(Rejected(reason))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_SECONDS) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if command[0] == "submit":
                self._admit(command[1])
            else:
                self._abort(command[1], command[2])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self, handle: RequestHandle) -> None:
        if handle.abort_reason is not None:
            return                                     # aborted before it reached the engine
        admitted = []                                  # the sequence, once add_request returns

        def on_tokens(toks: list[int]) -> None:        # Sequence.commit: its logprobs are set
            lps = admitted[0].logprobs
            handle.push(Tokens(list(toks), None if lps is None else lps[len(lps) - len(toks):]))
        try:
            seq = self.scheduler.add_request(handle.prompt_ids, handle.params, on_tokens=on_tokens)
            admitted.append(seq)
        except RequestError as e:
            handle.push(Rejected(str(e)))
            return
        handle.request_id = seq.request_id
        self._handles[seq.request_id] = handle
        handle.push(Admitted(seq.request_id))

    def _abort(self, handle: RequestHandle, reason: str) -> None:
        handle.abort_reason = reason
        if handle.request_id is None or self._handles.get(handle.request_id) is not handle:
            return      # not admitted yet, finished, or from a scheduler replaced after a failed step
        seq = self.scheduler.abort(handle.request_id, reason)
        self._handles.pop(handle.request_id, None)
        self._update_gauges()                          # before the client can hear it finished
        if seq is not None:
            handle.push(Finished(reason, copy_stats(seq.stats)))

    def _step(self) -> None:
        try:
            done = self.scheduler.step()
            self.steps_run += 1
        except Exception as e:                          # keep serving: fail this batch, start afresh
            log.exception("scheduler step failed; failing %d requests", len(self._handles))
            for handle in self._handles.values():
                handle.push(Finished("error", SpecStats(), f"internal error in the engine: {e}"))
            self._handles.clear()
            self.scheduler = self.llm.scheduler(self.speculative)
            return
        self._update_gauges()                          # before the clients can hear they finished
        for seq in done:
            handle = self._handles.pop(seq.request_id, None)
            if handle is not None:
                handle.push(Finished(seq.finish_reason, copy_stats(seq.stats), seq.error))

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        gen = self.scheduler
        self.metrics.running.set(len(gen.running))
        self.metrics.waiting.set(len(gen.waiting) + self._commands.qsize())
        self.metrics.kv_pages_in_use.set(gen.kv.num_pages - len(gen.kv.free))
        self.metrics.kv_pages_total.set(gen.kv.num_pages)
