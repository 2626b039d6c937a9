"""The draft's context of AR-fallback rounds, written late and in one batch (issue #25).

An AR round of the scheduler's fallback (``Scheduler._falls_back_to_ar``) commits one token per
row whose target taps the draft needs before it drafts again: the draft context at that position
(``ctx = hidden_norm(fc(taps))`` and each draft layer's K/V) depends only on the taps and the
position, not on when it is written. Writing it inside every AR round costs the draft's
context weights once per round; nothing reads it until the next speculative round (a probe, or a
batch that stops falling back). So the fallback's AR rounds keep their taps here, one row per
(sequence slot, pending position), and the next speculative round first writes all of a batch's
pending positions in one write of their rows, flat (``context_rows.py``: one CUDA graph per row
bucket under ``GraphedSteps``): the same cache contents (up to the summation order of a wider
matmul) for the weight read of one call.

A sequence admitted while its batch falls back to AR decoding defers its prompt's draft context
the same way (``add_prompt``: the prefill's taps of every prompt row, kept as they are): a request
that finishes inside the streak never pays the draft's context weights over its prompt, and one
that does not has it written with the streak's rows by the next speculative round.

A sequence's pending rows go when it leaves (finish, abort, preemption: its prefill rewrites the
whole context). The AR rows are a pool of ``slots x capacity`` rows that the slots share, handed
out as the rounds need them: a small batch's slots hold more than ``capacity`` rows each (one
slot up to the whole pool), so its streak flushes less often; when the pool is full the batch's
pending rows are flushed. With ``capacity`` rows per slot each, a batch of 1 of the default pair
flushed 9 times in 841 fallback AR rounds, each write ~3 ms of eager launches: 9 % of the AR
rounds' time (H100, session 41, d0fe5d0); with the pool 3 times, still ~2 ms each (session 42),
which the graphs of ``ContextRows`` take down to a few launches.

The AR rows live in the steps' ``tap_store`` (``DecodeSteps.keep_taps``): the AR round itself stores
its taps at the rows ``add`` hands out (``RoundInputs.tap_row``), inside its CUDA graph, so the
round's host path has no store of its own (an index upload and a scatter launch after the round's
read-back took ~0.1 ms of the H100's fallback AR rounds over plain ones, default pair, batches 4-16).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .context_rows import ContextRows

SLOT_ROWS = 64          # AR rows per slot in the shared pool (slots x SLOT_ROWS rows)


class DeferredContext:
    """Pending draft-context taps per sequence slot: the AR rows in ``store [slots x capacity,
    m*d]`` (the ``steps``' ``tap_store``, written by the AR rounds; ``rows``: each slot's rows of
    it, in order; ``free``: the rows no slot holds), a deferred prompt's rows in ``prompts``
    (before them), the positions on the host."""

    def __init__(self, steps, slots: int, capacity: int, writer: ContextRows | None = None):
        """``steps``: the ``DecodeSteps`` whose AR rounds store the taps (``keep_taps``); ``writer``
        writes the context (``flush``; default: eager writes through the steps' networks; the
        ``GraphedSteps``' replays its graphs)."""
        if capacity < 1:
            raise ValueError(f"DeferredContext: capacity must be >= 1, got {capacity}")
        self.slots, self.capacity, self.steps = slots, capacity, steps
        self.writer = writer or ContextRows(steps.nets)
        steps.reserve_taps(slots * capacity)
        self.positions: dict[int, list[int]] = {}            # slot -> pending AR positions, in order
        self.rows: dict[int, list[int]] = {}                 # slot -> their store rows, in the same order
        self.free = list(range(slots * capacity - 1, -1, -1))   # store rows no slot holds (a stack)
        self.prompts: dict[int, tuple[list[int], Tensor]] = {}   # slot -> (positions, taps [T, m*d])
        self.flushes = 0                                     # draft_context calls made
        self.flushed_rows = 0                                # positions they wrote
        self.prompts_deferred = 0                            # prompts whose context waited here
        self.prompt_rows_dropped = 0                         # ... rows never written (sequence left)

    @property
    def empty(self) -> bool:
        """Whether no slot has anything pending (the rounds' common case outside AR streaks)."""
        return not self.positions and not self.prompts

    def pending(self, slot: int) -> int:
        return len(self.positions.get(slot, ())) + len(self.prompts.get(slot, ((),))[0])

    def pending_rows(self, slots: list[int]) -> int:
        """The rows the next ``flush`` of ``slots`` writes."""
        return sum(self.pending(s) for s in slots)

    def add_prompt(self, slot: int, positions: list[int], taps: Tensor) -> None:
        """Keep the prompt rows ``taps [T, m*d]`` at ``positions`` of the sequence now in ``slot``
        (copied: the prefill's outputs may be a graph's buffers), before any AR row of it."""
        if self.pending(slot):
            raise RuntimeError(f"DeferredContext.add_prompt: slot {slot} still has pending rows")
        self.prompts[slot] = (list(positions), taps.clone())
        self.prompts_deferred += 1

    def prompt_room(self, rows: int) -> bool:
        """Whether ``rows`` more prompt rows fit: all deferred prompts together hold at most as
        many rows as the AR buffer (``slots x capacity``), so deferring never costs more memory
        than that (Qwen3-8B, 64 x 64 rows of 5 x 4096 bf16 taps: 168 MB)."""
        held = sum(len(p) for p, _ in self.prompts.values())
        return held + rows <= self.slots * self.capacity

    @property
    def store(self) -> Tensor:
        """[slots x capacity, m*d] the AR rows (a view of the steps' ``tap_store``)."""
        store = self.steps.tap_store
        if store is None or store.shape[0] < self.slots * self.capacity:
            raise RuntimeError("DeferredContext: no AR round has stored taps for these slots")
        return store[: self.slots * self.capacity]

    def add(self, slots: list[int], positions: list[int]) -> np.ndarray:
        """Rows at ``positions`` for ``slots`` (one each; the pool has room: ``room_for``) ->
        [B] int64 their ``store`` rows, where the AR round that computes them stores their taps
        (``RoundInputs.tap_row``)."""
        n = len(slots)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if len(self.free) < n:
            raise RuntimeError("DeferredContext.add: the AR rows are all held; flush first")
        rows = self.free[-n:]                     # (every AR round of a streak: kept lean)
        del self.free[-n:]
        for s, p, r in zip(slots, positions, rows):
            held = self.rows.get(s)
            if held is None:
                self.positions[s], self.rows[s] = [p], [r]
            else:
                held.append(r)
                self.positions[s].append(p)
        return np.array(rows, dtype=np.int64)

    def room_for(self, slots: list[int]) -> bool:
        """Whether the pool has a row for each of ``slots``."""
        return len(self.free) >= len(slots)

    def _release(self, slot: int) -> list[int]:
        """``slot``'s store rows, given back to the pool."""
        rows = self.rows.pop(slot, [])
        self.free.extend(rows)
        return rows

    def flush(self, slots: list[int], table: Tensor) -> None:
        """Write the pending context of ``slots`` (rows of ``table [len(slots), pages]``) in one
        ``ContextRows.write`` of their rows, flat: every AR row by one gather from the store, then
        each deferred prompt's rows."""
        R = self.pending_rows(slots)
        if R == 0:
            return
        ar = [(i, self.positions.pop(s, []), self._release(s)) for i, s in enumerate(slots)]
        prompts = [(i, *self.prompts.pop(s)) for i, s in enumerate(slots) if s in self.prompts]
        A = sum(len(r) for _, _, r in ar)
        positions, table_rows = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
        source = np.empty(A, dtype=np.int64)                     # the AR rows' store rows
        k = 0
        for i, p, r in ar:
            positions[k:k + len(p)], table_rows[k:k + len(p)], source[k:k + len(p)] = p, i, r
            k += len(p)
        store = self.store if A else None
        rows = self.writer.rows(R, store if A else prompts[0][2])   # [R, m*d]
        with torch.inference_mode():
            if A:
                torch.index_select(store, 0, torch.from_numpy(source).to(store.device), out=rows[:A])
            for i, p, t in prompts:
                positions[k:k + len(p)], table_rows[k:k + len(p)] = p, i
                rows[k:k + len(p)].copy_(t)
                k += len(p)
        self.writer.write(rows, positions, table_rows, table)
        self.flushes += 1
        self.flushed_rows += R

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s pending rows (its sequence left)."""
        self.positions.pop(slot, None)
        self._release(slot)
        prompt = self.prompts.pop(slot, None)
        if prompt is not None:
            self.prompt_rows_dropped += len(prompt[0])
