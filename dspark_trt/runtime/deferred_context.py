"""The draft's context of AR-fallback rounds, written late and in one batch (issue #25).

An AR round of the scheduler's fallback (``Scheduler._falls_back_to_ar``) commits one token per
row whose target taps the draft needs before it drafts again: the draft context at that position
(``ctx = hidden_norm(fc(taps))`` and each draft layer's K/V) depends only on the taps and the
position, not on when it is written. Writing it inside every AR round costs the draft's
context weights once per round; nothing reads it until the next speculative round (a probe, or a
batch that stops falling back). So the fallback's AR rounds keep their taps here, one row per
(sequence slot, pending position), and the next speculative round first writes all of a batch's
pending positions with one ``draft_context`` call over ``[b, L]`` rows: the same cache contents
(up to the summation order of a wider matmul) for the weight read of one call.

A sequence admitted while its batch falls back to AR decoding defers its prompt's draft context
the same way (``add_prompt``: the prefill's taps of every prompt row, kept as they are): a request
that finishes inside the streak never pays the draft's context weights over its prompt, and one
that does not has it written with the streak's rows by the next speculative round.

A sequence's pending rows go when it leaves (finish, abort, preemption: its prefill rewrites the
whole context). ``capacity`` AR rows per slot; a full slot is flushed before it takes another.

The AR rows live in the steps' ``tap_store`` (``DecodeSteps.keep_taps``): the AR round itself stores
its taps at the rows ``add`` hands out (``RoundInputs.tap_row``), inside its CUDA graph, so the
round's host path has no store of its own (an index upload and a scatter launch after the round's
read-back took ~0.1 ms of the H100's fallback AR rounds over plain ones, default pair, batches 4-16).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

SLOT_ROWS = 64          # AR rows kept per slot (the scheduler's longest streak between probes)


class DeferredContext:
    """Pending draft-context taps per sequence slot: the AR rows in ``buffer [slots, capacity,
    m*d]`` (the ``steps``' ``tap_store``, written by the AR rounds), a deferred prompt's rows in
    ``prompts`` (before them), the positions on the host."""

    def __init__(self, steps, slots: int, capacity: int):
        """``steps``: the ``DecodeSteps`` whose AR rounds store the taps (``keep_taps``) and whose
        networks write the context (``flush``)."""
        if capacity < 1:
            raise ValueError(f"DeferredContext: capacity must be >= 1, got {capacity}")
        self.nets, self.slots, self.capacity, self.steps = steps.nets, slots, capacity, steps
        steps.reserve_taps(slots * capacity)
        self.positions: dict[int, list[int]] = {}            # slot -> pending AR positions, in order
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
    def buffer(self) -> Tensor:
        """[slots, capacity, m*d] the AR rows (a view of the steps' ``tap_store``)."""
        store = self.steps.tap_store
        if store is None or store.shape[0] < self.slots * self.capacity:
            raise RuntimeError("DeferredContext: no AR round has stored taps for these slots")
        return store[: self.slots * self.capacity].view(self.slots, self.capacity, -1)

    def add(self, slots: list[int], positions: list[int]) -> np.ndarray:
        """Rows at ``positions`` for ``slots`` (one each; every slot has room: ``room_for``) ->
        [B] int64 their ``tap_store`` rows, where the AR round that computes them stores their
        taps (``RoundInputs.tap_row``)."""
        rows = [len(self.positions.get(s, ())) for s in slots]
        if max(rows, default=0) >= self.capacity:
            raise RuntimeError("DeferredContext.add: a slot is full; flush it first")
        for s, p in zip(slots, positions):
            self.positions.setdefault(s, []).append(p)
        return np.array([s * self.capacity + r for s, r in zip(slots, rows)], dtype=np.int64)

    def room_for(self, slots: list[int]) -> bool:
        return all(len(self.positions.get(s, ())) < self.capacity for s in slots)

    def flush(self, slots: list[int], table: Tensor) -> None:
        """Write the pending context of ``slots`` (rows of ``table [len(slots), pages]``) in one
        ``draft_context`` call; slots with nothing pending are inert rows (position -1)."""
        L = max((self.pending(s) for s in slots), default=0)
        if L == 0:
            return
        pos = np.full((len(slots), L), -1, dtype=np.int64)
        prompts = [self.prompts.pop(s, ([], None)) for s in slots]
        for i, s in enumerate(slots):
            p = prompts[i][0] + self.positions.pop(s, [])
            pos[i, :len(p)] = p
        if not any(t is not None for _, t in prompts):            # AR rows only: one slice
            taps = self.buffer[torch.tensor(slots, device=self.buffer.device), :L]     # [b, L, m*d]
        else:
            ref = next(t for _, t in prompts if t is not None)
            taps = ref.new_zeros(len(slots), L, ref.shape[-1])
            for i, (s, (pp, t)) in enumerate(zip(slots, prompts)):
                n = len(pp)
                if t is not None:
                    taps[i, :n] = t
                ar = int((pos[i] >= 0).sum()) - n
                if ar:
                    taps[i, n:n + ar] = self.buffer[s, :ar]
        self.nets.draft_context(taps, torch.from_numpy(pos).to(taps.device), table)
        self.flushes += 1
        self.flushed_rows += int((pos >= 0).sum())

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s pending rows (its sequence left)."""
        self.positions.pop(slot, None)
        prompt = self.prompts.pop(slot, None)
        if prompt is not None:
            self.prompt_rows_dropped += len(prompt[0])
