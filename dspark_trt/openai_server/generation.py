"""One request's generation as seen from the event loop: submit, stream text, finish.

``RequestRun`` turns the engine's token events into ``Delta``s (text from the incremental
detokenizer, then stop strings; the tokens and, if asked, their logprobs), records latency
metrics, and on a stop-string match or a disconnect aborts the sequence in the engine so its KV
pages are freed. ``merge_runs`` interleaves the deltas of several runs (``n`` > 1, prompt lists).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

from ..runtime.logprobs import TokenLogprob
from ..runtime.sampling_params import SamplingParams, SpecStats
from .detokenizer import IncrementalDetokenizer
from .engine import Admitted, EngineThread, Finished, Rejected, RequestHandle, Tokens
from .errors import APIError
from .metrics import ServerMetrics
from .stop_strings import StopStringMatcher


_BACKGROUND: set[asyncio.Task] = set()       # tasks that must not be garbage-collected early


@dataclass
class Delta:
    """What one engine event (or the final flush) adds to a choice: ``text`` to send, the tokens
    it consumed with their offsets in the (uncut) text and, if asked, their logprobs."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request with ``seed`` (None stays None: drawn at
    admission): sample 0 keeps it, the others get a hash of (seed, index), so every sample is
    reproducible and they differ."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"dspark-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def spec_summary(stats: SpecStats) -> dict:
    """The ``dspark`` extension field of a response: this request's speculative statistics."""
    return {"tau": stats.tau, "acceptance_per_position": stats.acceptance_per_position(),
            "rounds": stats.rounds, "num_spec_tokens": stats.num_spec_tokens,
            "accepted": sum(stats.accepted), "proposed": sum(stats.proposed),
            "committed": sum(stats.committed), "verified_per_round": stats.verified_per_round,
            "admitted_acceptance": stats.admitted_acceptance}


class RequestRun:
    def __init__(self, engine: EngineThread, metrics: ServerMetrics, tokenizer, prompt_ids: list[int],
                 params: SamplingParams, stop: list[str]):
        self.engine, self.metrics = engine, metrics
        self.prompt_ids = prompt_ids
        self.handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop())
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = StopStringMatcher(stop)
        self.arrival = time.perf_counter()
        self.token_ids: list[int] = []
        self.text_len = 0                                # characters decoded so far (before stops)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stats = SpecStats()
        self._last_token_time: float | None = None

    async def start(self) -> None:
        """Submit and wait for admission; a request the scheduler refuses becomes a 400."""
        self.engine.submit(self.handle)
        event = await self.handle.events.get()
        if isinstance(event, Rejected):
            param = "max_tokens" if "max_new_tokens" in event.message else None
            raise APIError(event.message, param=param)
        assert isinstance(event, Admitted), event

    async def deltas(self):
        """Yield a ``Delta`` per round (one per engine event, even if its text is held back);
        afterwards ``finish_reason``, ``token_ids``, ``stats`` are final. Cancelled (client gone)
        -> the sequence is aborted in the engine."""
        stopped = False
        try:
            while True:
                event = await self.handle.events.get()
                if isinstance(event, Tokens) and not stopped:
                    delta = Delta("")                   # one delta per round: its tokens together
                    parts = []
                    for j, token in enumerate(event.token_ids):
                        self.token_ids.append(token)
                        delta.token_ids.append(token)
                        delta.offsets.append(self.text_len)
                        if event.logprobs is not None:
                            delta.logprobs.append(event.logprobs[j])
                        piece = self.detokenizer.add([token])
                        self.text_len += len(piece)
                        parts.append(self.stop.feed(piece))
                        if self.stop.matched is not None:
                            stopped = True
                            self.engine.abort(self.handle, "stop")
                            break
                    self._observe_latency(len(parts))   # the tokens this response delivers
                    delta.text = "".join(parts)
                    yield delta
                elif isinstance(event, Finished):
                    self.stats, self.error = event.stats, event.error
                    if not stopped:
                        tail = self.stop.flush()
                        if tail:
                            yield Delta(tail)
                    self.finish_reason = "stop" if stopped else event.finish_reason
                    self._record_finished()
                    return
        finally:
            if self.finish_reason is None:              # cancelled or closed early: free the pages
                self.engine.abort(self.handle, "abort")
                task = asyncio.get_running_loop().create_task(self._record_abort())
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)

    async def _record_abort(self) -> None:
        """After a disconnect: wait for the engine's Finished event and count the request."""
        while not isinstance(event := await self.handle.events.get(), Finished):
            if isinstance(event, Tokens):
                self.token_ids.extend(event.token_ids)
        self.stats, self.finish_reason = event.stats, "abort"
        self._record_finished()

    def _observe_latency(self, num_tokens: int) -> None:
        """TTFT for the first token; one inter-token interval per later token (the tokens of one
        round arrive together: the first of them waited, the others 0)."""
        now = time.perf_counter()
        if self._last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self._last_token_time)
        for _ in range(num_tokens - 1):
            self.metrics.itl.observe(0.0)
        self._last_token_time = now

    def _record_finished(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.record_finished(self.finish_reason, len(self.prompt_ids), len(self.token_ids),
                                     self.stats)

    async def text_deltas(self):
        """The text of ``deltas`` (non-empty pieces only)."""
        async for delta in self.deltas():
            if delta.text:
                yield delta.text

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids),
                "total_tokens": len(self.prompt_ids) + len(self.token_ids)}


def total_usage(runs: list[RequestRun], prompts: list[list[int]]) -> dict:
    """One response's usage over its choices: each prompt counted once (as OpenAI and vLLM do
    for ``n``), every choice's completion tokens."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(r.token_ids) for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def merge_runs(runs: list[RequestRun]):
    """Yield (choice index, ``Delta``) from all runs as they arrive, and (index, None) when run
    ``index`` has finished; closing the generator cancels the runs (their sequences are aborted)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: RequestRun):
        try:
            async for delta in run.deltas():
                queue.put_nowait((i, delta))
        except BaseException as e:                   # noqa: BLE001  (passed to the consumer)
            queue.put_nowait((i, e))
            raise
        queue.put_nowait((i, None))
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    raise asyncio.CancelledError()
                raise item
            left -= item is None
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
