"""The running batch's per-request constants, built once per batch composition.

Most of a round's host inputs (``RoundInputs``) are fields of each request's ``SamplingParams``
and its slot, which change only when the batch does (an admission, a finish, a preemption); per
round only the anchors, positions and page tables move. ``BatchConstantsCache.get(seqs)`` gives
the former for a batch in order, with the flags its rounds branch on (the modifiers, the logprob
top-k, whether every row is ``scheduled``), rebuilt only when the batch's (request, slot) pairs
change. (H100, default pair, steady load at batch 64: ``Scheduler.round_inputs`` took 0.16-0.20
ms a round when it rebuilt all of it per row, ``scheduler-overheads-b8-b64-...-5ffb290``.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .confidence import MODE_IDS
from .sampling_modifiers import Modifiers

FLOAT_FIELDS = ("temperature", "top_p", "threshold", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")


@dataclass(frozen=True)
class BatchConstants:
    key: tuple                          # ((request id, slot), ...) of the batch, in order
    fields: dict[str, np.ndarray]       # ``RoundInputs`` fields [B] that only the batch changes
    mods: Modifiers                     # the batch's sampling modifiers
    logprobs_k: int | None              # the top-k its rows' ``logprobs`` need (None: no row asks)
    all_scheduled: bool                 # every row's verify_mode is "scheduled"

    @classmethod
    def build(cls, seqs, key: tuple) -> "BatchConstants":
        params = [s.params for s in seqs]
        fields = {f: np.array([getattr(p, f if f != "threshold" else "confidence_threshold") for p in params],
                              dtype=np.float32) for f in FLOAT_FIELDS}
        fields.update(seed=np.array([s.seed for s in seqs], dtype=np.int64),
                      slot=np.array([s.slot for s in seqs], dtype=np.int64),
                      top_k=np.array([p.top_k for p in params], dtype=np.int64),
                      verify_mode=np.array([MODE_IDS[p.verify_mode] for p in params], dtype=np.int64))
        for a in fields.values():
            a.setflags(write=False)     # shared by every round of this batch
        ks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(key, fields, Modifiers.for_params(params), max(ks) if ks else None,
                   all(p.verify_mode == "scheduled" for p in params))


class BatchConstantsCache:
    """The ``BatchConstants`` of the last two batches asked for (the running batch's rounds and an
    admission's prefill alternate)."""

    def __init__(self):
        self._recent: list[BatchConstants] = []

    def get(self, seqs) -> BatchConstants:
        key = tuple((s.request_id, s.slot) for s in seqs)
        for c in self._recent:
            if c.key == key:
                return c
        self._recent = self._recent[-1:] + [BatchConstants.build(seqs, key)]
        return self._recent[-1]
