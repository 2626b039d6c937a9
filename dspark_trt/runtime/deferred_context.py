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

A sequence's pending rows go when it leaves (finish, abort, preemption: its prefill rewrites the
whole context). ``capacity`` rows per slot; a full slot is flushed before it takes another.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class DeferredContext:
    """Pending draft-context taps per sequence slot: ``buffer [slots, capacity, m*d]`` on the
    device (allocated at the first ``add``) and the positions on the host."""

    def __init__(self, networks, slots: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"DeferredContext: capacity must be >= 1, got {capacity}")
        self.nets, self.slots, self.capacity = networks, slots, capacity
        self.buffer: Tensor | None = None                    # [slots, capacity, m*d]
        self.positions: dict[int, list[int]] = {}            # slot -> pending positions, in order
        self.flushes = 0                                     # draft_context calls made
        self.flushed_rows = 0                                # positions they wrote

    def pending(self, slot: int) -> int:
        return len(self.positions.get(slot, ()))

    def add(self, slots: list[int], positions: list[int], taps: Tensor) -> None:
        """Keep ``taps [B, m*d]`` of rows at ``positions`` for ``slots`` (one row each; every slot
        has room: ``room_for``)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.slots, self.capacity, taps.shape[-1], dtype=taps.dtype,
                                      device=taps.device)
        rows = [self.pending(s) for s in slots]
        if max(rows, default=0) >= self.capacity:
            raise RuntimeError("DeferredContext.add: a slot is full; flush it first")
        idx = torch.tensor([slots, rows], dtype=torch.int64).to(taps.device, non_blocking=True)
        self.buffer[idx[0], idx[1]] = taps
        for s, p in zip(slots, positions):
            self.positions.setdefault(s, []).append(p)

    def room_for(self, slots: list[int]) -> bool:
        return all(self.pending(s) < self.capacity for s in slots)

    def flush(self, slots: list[int], table: Tensor) -> None:
        """Write the pending context of ``slots`` (rows of ``table [len(slots), pages]``) in one
        ``draft_context`` call; slots with nothing pending are inert rows (position -1)."""
        L = max((self.pending(s) for s in slots), default=0)
        if L == 0:
            return
        pos = np.full((len(slots), L), -1, dtype=np.int64)
        for i, s in enumerate(slots):
            p = self.positions.pop(s, [])
            pos[i, :len(p)] = p
        taps = self.buffer[torch.tensor(slots, device=self.buffer.device), :L]     # [b, L, m*d]
        self.nets.draft_context(taps, torch.from_numpy(pos).to(self.buffer.device), table)
        self.flushes += 1
        self.flushed_rows += int((pos >= 0).sum())

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s pending rows (its sequence left)."""
        self.positions.pop(slot, None)
