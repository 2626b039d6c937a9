"""The draft-verify loop with continuous batching (algorithm doc §1, steps 1-7).

Per round, for every running sequence with anchor at position P (``steps.py`` has the two steps):
  draft step    draft_block(anchor, P)          -> drafts x [B, N], proposal logits z [B, N, V]
  verify step   target([anchor, x], P .. P+N)   -> logits [B, N+1, V], taps [B, N+1, m*d]
                verify                          -> accepted a [B], next token [B]
                draft_context(taps, rows 0..a)  -> draft KV at P .. P+a (rows > a at position -1)
  host          one copy of (a, next, x) [B, 2+N] -- the round's only synchronisation
                commit x[:a] + next; P += a + 1; anchor = next
Rejected KV positions need no copy: the next round overwrites them before anything reads them.
A row whose target logits are not finite (NaN / Inf: broken weights, overflow) comes back flagged
(accepted -1, or token -1; ``steps.py``) and its request ends with finish_reason "error" and
``NONFINITE_LOGITS`` as its error, never as a made-up token or stop.
Confidence modes (``SamplingParams.verify_mode``, ``confidence.py``): the round also drafts the
confidence logits, each row verifies only its admitted prefix of ``l <= N`` drafts (exact), and the
request's ``SpecStats`` records ``l`` as the round's proposal length.
Sampling modifiers (top-k, min-p, top-p, penalties; ``sampling_modifiers.py``) apply to the
target logits of the prefill, the AR and the verify step alike; each running sequence owns a slot
(0 .. max_batch_size-1) whose row of ``DecodeSteps.counts`` holds its token counts for the penalties
(reset at admission, updated on the device by the steps).
Requests join (prefill, eager) and leave (finish or abort) between rounds. KV pages are reserved
incrementally (``PagedKVManager``): at admission for the context + one round's block, and before
every round for what that round may write (position P + N). When the free pages cannot cover a
running sequence's next round, the most recently admitted one is preempted by recomputation: its
pages and slot are freed, it goes back to the front of the queue with its output so far, and on
re-admission a prefill over prompt + output (up to the anchor) rebuilds its target and draft
caches and its penalty counts; nothing it produced is lost or re-sent, and its sampling stays
the same (the sampler's randomness is keyed by seed and position). The steps run eagerly
(``DecodeSteps``) or from CUDA graphs per batch bucket (``cuda_graphs.GraphedSteps``).
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from .. import plugins
from .batch_constants import BatchConstants, BatchConstantsCache
from .kv_manager import PagedKVManager
from .survival import SurvivalEstimate
from .verify_scheduler import AR_STAY_MARGIN, CONFIDENCE_PROBE_EVERY, HEAD_PROBE_EVERY, TRIM_MARGIN
from .deferred_context import SLOT_ROWS, DeferredContext
from .logprobs import LogprobRows, TokenLogprob, token_logprobs, to_host
from .sampling_params import RequestError, RequestOutput, SamplingParams, SpecStats
from .sampling_modifiers import uses_penalties
from .steps import DecodeSteps, DeviceInputs, RoundInputs

AR_PROBE_EVERY = 8           # AR fallback rounds before a scheduled round measures tau again,
AR_PROBE_MAX = 64            # doubled after each probe that confirms AR, up to this
PROBE_BUDGET = 0.01          # and at least so many that the probes' expected loss (in AR rounds,
                             # ``VerifyScheduler.probe_loss``) is at most this share of the streak
                             # (2-core CPU, default pair, 16 / 64 rows: probes priced at 0.3-0.6 AR
                             # rounds; 2 in 65 rounds cost 1.5-1.7 %, fa5669e + 0.02)
AR_PROBE_LIMIT = 256         # but never more AR rounds than this between probes
STREAK_TURNOVER = 0.5        # an AR streak ends once finished requests were this share of its batch
UNDECIDED = -1               # ``Scheduler._ready_window``: no decision ready, decide on the round's path
PACKED_PROBE_EVERY = 8           # packed model: a packed round at least every this many fixed rounds
NONFINITE_LOGITS = ("the target produced non-finite logits (NaN or Inf) for this request; "
                    "generation stopped (check the weights and the dtype)")


@dataclass
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    anchor: int = -1                    # last committed token; its target KV is not written yet
    position: int = 0                   # P: the anchor's position
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    on_tokens: Callable[[list[int]], None] | None = None
    table_row: np.ndarray | None = None  # [max_pages] int64 page ids (-1 padded), set at admission
    error: str | None = None            # why, when finish_reason is "error"
    confidence: list | None = None      # per round: (confidence logits [N], verified, accepted)
                                        # when the scheduler records them (calibration data)
    slot: int = -1                      # its row of the penalties' token counts, while running
    logprobs: list[TokenLogprob] | None = None   # per output token, when params.logprobs is set
    _stops: set[int] | None = field(default=None, repr=False)    # ``stop_ids``, once

    def stop_ids(self, eos: Iterable[int]) -> set[int]:
        """Its stop tokens under the scheduler's ``eos`` (built once: the scheduler's eos is fixed)."""
        if self._stops is None:
            self._stops = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(eos))
        return self._stops

    def fail(self, message: str) -> None:
        """End the request with finish_reason "error" (its committed tokens stay)."""
        self.finish_reason, self.error = "error", message

    def commit(self, tokens: list[int], stop_ids: set[int], rows: LogprobRows | None = None,
               row: int = 0) -> list[int]:
        """Append tokens up to the first stop token (inclusive) or the length limit; with
        ``rows`` (a step's logprobs) their entries from row ``row`` go to ``logprobs`` first."""
        room = self.params.max_new_tokens - len(self.output_ids)
        new = []
        for t in tokens[:room]:
            new.append(t)
            if t in stop_ids:
                self.finish_reason = "stop"
                break
        self.output_ids += new
        if self.params.logprobs is not None and rows is not None:
            self.logprobs = (self.logprobs or []) + rows.entries(row, new, self.params.logprobs)
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if new and self.on_tokens is not None:
            self.on_tokens(new)
        return new


class Scheduler:
    """Schedules requests over the paged caches of ``networks`` and runs rounds on them."""

    def __init__(self, networks, max_batch_size: int, max_seq_len: int, vocab_size: int,
                 eos_token_ids: Iterable[int] = (), speculative: bool = True, steps=None,
                 record_confidence: bool = False):
        """``steps``: ``DecodeSteps(networks)`` (default, eager) or a ``GraphedSteps`` over it.
        ``record_confidence``: keep each round's confidence logits in ``Sequence.confidence``."""
        self.nets = networks
        self.steps = steps or DecodeSteps(networks)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.speculative = speculative and networks.num_spec_tokens > 0
        self.device = networks.device
        self.headroom = networks.num_spec_tokens + 1           # verify writes up to P + N
        self.kv = PagedKVManager(networks.num_pages, networks.page_size,
                                 -(-(max_seq_len + self.headroom) // networks.page_size))
        self.record_confidence = record_confidence and self.speculative
        if self.record_confidence and not getattr(networks, "has_confidence", False):
            raise RequestError("record_confidence: this draft has no confidence head")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # the AR fallback of all-scheduled batches: the recent speculative rounds' prefix-survival
        # estimate (verified outcomes; before any, the calibration's held-out survival where it has
        # one), and AR rounds since the last speculative one (a probe every AR_PROBE_EVERY)
        sched = self._scheduler()
        measured = None if sched is None else sched.calibration.survival(networks.num_spec_tokens)
        self._survival = SurvivalEstimate(networks.num_spec_tokens, measured=measured)
        self._ar_streak, self._probe_every, self._probing = 0, AR_PROBE_EVERY, False
        self._aged = 0                         # AR rounds of the streak its survival estimate has aged by
        self._streak_inputs: tuple = (None, None)   # (batch constants, survival curve) of the streak's decision
        self._probe_floor = 0                  # the streak's probe interval from PROBE_BUDGET
        self._turnover = 0.0                   # the share of the batch that finished during the streak
        self._drafts_next: tuple | None = None  # (curve, rows, cost, window): ``_drafting_decision``
        self._fixed_streak = 0                 # packed model: fixed rounds since the last packed one
        self._window_streak = 0                # window rounds since the last confidence probe
        self._head_streak = 0                  # packed rounds of a narrowed head since one drafted all N
        self._packed_gain: tuple = (None, 0.0)  # (the confidences it was computed from, packed_gain)
        # the fallback AR rounds' draft context, written by the next speculative round
        # (``defer_context=False``: by each AR round itself, the reference behaviour)
        self.defer_context = True
        self.deferred = DeferredContext(self.steps.eager, max_batch_size, SLOT_ROWS, self.steps.context_rows)
        self._free_slots = list(range(max_batch_size))      # token-count rows of running sequences
        self.constants = BatchConstantsCache()              # the batch's per-request round inputs and flags
        self._next_id = 0
        self.preemptions = 0                                # sequences preempted for KV pages
        # admission prefills: calls, sequences and host seconds (each ends in a device read-back,
        # so the wall time is the prefill's, the previous round having synchronised too)
        self.prefill_calls, self.prefill_seqs, self.prefill_seconds = 0, 0, 0.0
        # rounds as the host saw them, when a list (benchmarks): (kind, rows, wall ms); kind
        # "fixed", "window", "confidence", "confidence_head" (a packed round of a narrowed head),
        # "ar" (AR decoding or the fallback, logprobs or not) or "logprobs" (a speculative round with
        # logprob outputs)
        self.round_log: list[tuple[str, int, float]] | None = None
        self._round_kind, self._round_width = "", None      # the last round's kind (and window)
        self._flushed = False                  # whether the last speculative round wrote deferred context

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    on_tokens: Callable[[list[int]], None] | None = None) -> Sequence:
        """Validate and queue a request; raises ``RequestError`` (nothing queued) if invalid."""
        params.validate()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.max_seq_len:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                               f"({params.max_new_tokens}) = {need} exceeds max_seq_len {self.max_seq_len}")
        if not self.kv.fits_ever(need + self.headroom):
            raise RequestError(f"request needs {self.kv.pages_for(need + self.headroom)} KV pages, the "
                               f"cache has {self.kv.num_pages}: it can never be scheduled")
        if (params.verify_mode != "fixed" and self.speculative
                and not getattr(self.nets, "has_confidence", False)):
            raise RequestError(f"verify_mode {params.verify_mode!r} needs a draft with a confidence "
                               f"head (confidence_head.proj); this one has none: use 'fixed'")
        if params.logprobs is not None and self.record_confidence:
            raise RequestError("logprobs: not with record_confidence (calibration runs)")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(self._next_id, prompt_ids, params, int(seed), on_tokens=on_tokens)
        seq.stats.num_spec_tokens = self.nets.num_spec_tokens if self.speculative else 0
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: int, reason: str = "abort") -> Sequence | None:
        """Drop a waiting or running request between steps and free its pages.

        Returns the sequence (``finish_reason`` set to ``reason`` unless it had finished) or None
        if the id is unknown or already done.
        """
        for queue in (self.waiting, self.running):
            seq = next((s for s in queue if s.request_id == request_id), None)
            if seq is not None:
                queue.remove(seq)
                if queue is self.running:
                    self._release(seq)
                seq.finish_reason = seq.finish_reason or reason
                return seq
        return None

    # ---- one scheduler step ------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Reserve the running sequences' next round (preempting if short), admit waiting requests,
        run one round for the running ones; return finished sequences."""
        decoding = self._reserve_round([s for s in self.running if s.finish_reason is None])
        admitted = []
        while (self.waiting and len(self.running) + len(admitted) < self.max_batch_size
               and self.kv.can_allocate(self._need(self.waiting[0]))):
            seq = self.waiting.popleft()
            pages = self.kv.allocate(seq.request_id, self._need(seq))
            seq.table_row = np.full(self.kv.max_pages_per_seq, -1, dtype=np.int64)
            seq.table_row[:len(pages)] = pages
            seq.slot = self._free_slots.pop()
            admitted.append(seq)
        if admitted:
            t0 = time.perf_counter()
            self._prefill(admitted)
            self.prefill_calls, self.prefill_seqs = self.prefill_calls + 1, self.prefill_seqs + len(admitted)
            self.prefill_seconds += time.perf_counter() - t0
        if decoding:
            t0 = time.perf_counter()
            (self._spec_round if self.speculative else self._ar_round)(decoding)
            wall_ms = 1e3 * (time.perf_counter() - t0)   # the round ends in a read-back: wall = its cost
            if self.round_log is not None:
                self.round_log.append((self._round_kind, len(decoding), wall_ms))
            self._observe_round(len(decoding), wall_ms)
        done = [s for s in self.running if s.finish_reason is not None]
        for s in done:
            self.running.remove(s)
            self._release(s)
        if done and decoding and self.speculative and self._tracks_survival():
            rows = {id(s) for s in decoding}                      # (identity: a Sequence is a dataclass)
            self._finished_share(sum(id(s) in rows for s in done) / len(decoding))
        return done

    def _finished_share(self, share: float) -> None:
        """Requests that were ``share`` of the round's rows finished: their rows age out of the
        survival window (``SurvivalEstimate.forget``), and an AR streak during which ``STREAK_TURNOVER``
        of the batch finished ends (aging the window by its AR rounds first), so the next round
        decides afresh, from the start rule's upper bound and with the first probe interval: the
        streak's evidence was of requests that left. Without it a batch-1 streak went on into the
        next requests, deciding by the stay rule from the history of the hard request before them
        and probing at the interval that request had doubled (CPU replay of the H100's e51681e prices,
        bf16: a request accepting 2.08 drafts a fixed round ran 71 AR rounds and 2 probes, 21.0
        against 13.3 ms)."""
        if self._ar_streak > 0:
            self._turnover += share
            if self._turnover >= STREAK_TURNOVER:
                self._turnover = 0.0
                self._probe_every, self._probing, self._probe_floor = AR_PROBE_EVERY, False, 0
                self._streak_turned_over()
        self._survival.forget(share)

    def _streak_turned_over(self) -> None:
        """End the AR streak whose batch turned over, aging the window by its AR rounds."""
        self._age_by_streak()
        self._end_streak()

    def _age_by_streak(self) -> None:
        """Age the survival window by the streak's AR rounds it has not aged by yet (``age``)."""
        if self._ar_streak > self._aged:
            self._survival.age(self._ar_streak - self._aged)
            self._aged = self._ar_streak

    def _end_streak(self) -> None:
        self._ar_streak, self._aged, self._streak_inputs, self._turnover = 0, 0, (None, None), 0.0

    def _observe_round(self, rows: int, wall_ms: float) -> None:
        """Give the AR fallback's round costs (``VerifyScheduler.round_costs``) this round's wall:
        the fallback's AR rounds and the speculative rounds it weighs them against (not the first
        after an AR streak, which also writes the streak's deferred draft context)."""
        sched = self._scheduler() if self.speculative else None
        costs = getattr(sched, "round_costs", None)
        kind = self._round_kind
        if costs is None or not sched.falls_back or kind not in ("ar", "fixed", "window", "confidence"):
            return
        if kind != "ar" and self._flushed:
            return        # a probe after an AR streak: its wall has the streak's context write too
        width = self._round_width if kind in ("window", "confidence") else None
        costs.observe(kind, rows, wall_ms, sched.priced_ms(kind, rows, width))

    def _release(self, s: Sequence) -> None:
        self.kv.release(s.request_id)
        self.deferred.drop(s.slot)
        self._free_slots.append(s.slot)

    def _need(self, s: Sequence) -> int:
        """Tokens of cache ``s`` needs for its next round: up to its anchor's position P (the
        prompt's length before its prefill) + the verify block."""
        return (s.position if s.output_ids else len(s.prompt_ids)) + self.headroom

    def _reserve_round(self, seqs: list[Sequence]) -> list[Sequence]:
        """Grow the pages of ``seqs`` (running, in admission order) for their next round; when the
        free pages run short, preempt the most recently admitted of them (possibly the one that
        needs them) -> the sequences that keep running."""
        keep = list(seqs)
        i = 0
        while i < len(keep):
            s = keep[i]
            need = self._need(s)
            missing = self.kv.missing(s.request_id, need)    # preempting others frees pages, not s's need
            if missing:
                while missing > len(self.kv.free) and keep[-1] is not s:
                    self._preempt(keep.pop())
                if missing > len(self.kv.free):
                    self._preempt(keep.pop())               # s itself: nothing later to preempt
                    continue
                have = len(self.kv.owned[s.request_id])
                pages = self.kv.grow(s.request_id, need)
                s.table_row[have:have + len(pages)] = pages
            i += 1
        return keep

    def _preempt(self, s: Sequence) -> None:
        """Free ``s``'s pages and slot; it waits at the front of the queue to be recomputed."""
        self.running.remove(s)
        self._release(s)
        s.table_row, s.slot = None, -1
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _table(self, seqs: list[Sequence]):
        return self.kv.table([s.request_id for s in seqs], self.device)

    def _tensor(self, values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=self.device)

    def round_inputs(self, seqs: list[Sequence], constants: BatchConstants | None = None) -> RoundInputs:
        """The next round's inputs of running sequences (prefilled: anchor and position set), in
        order (``constants``: the batch's, where the caller has them); public: bench and profiling
        stage a real round's inputs with it (``steps.stage(gen.round_inputs(seqs))``)."""
        c = constants or self.constants.get(seqs)
        return RoundInputs(anchor=np.array([s.anchor for s in seqs], dtype=np.int64),
                           start=np.array([s.position for s in seqs], dtype=np.int64),
                           table=np.stack([s.table_row for s in seqs]), **c.fields)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Target over the prompts (right-padded, pad position -1) and the draft context
        (``steps.prefill``: CUDA graphs of padded shapes where they exist), first token.
        A preempted sequence (it has output) is recomputed over prompt + output up to its anchor:
        its caches and penalty counts are rebuilt, its anchor and position kept, nothing sampled."""
        ctx = [s.prompt_ids + s.output_ids[:-1] for s in seqs]
        resumed = [bool(s.output_ids) for s in seqs]
        L = max(len(c) for c in ctx)
        tokens = self._tensor([c + [0] * (L - len(c)) for c in ctx])
        positions = self._tensor([list(range(len(c))) + [-1] * (L - len(c)) for c in ctx])
        table = self._table(seqs)
        lens = self._tensor([len(c) for c in ctx])
        if self._defers_prompts(seqs, sum(len(c) for c in ctx)):      # the draft's context waits
            last, taps = self.steps.prefill(tokens, positions, table, lens, False, keep_taps=True)
            for i, (s, c) in enumerate(zip(seqs, ctx)):
                self.deferred.add_prompt(s.slot, list(range(len(c))), taps[i, :len(c)])
        else:
            last = self.steps.prefill(tokens, positions, table, lens, self.speculative)   # [B, V]
        finite = torch.isfinite(last).all(dim=-1)
        raw = last
        c = self.constants.get(seqs)
        mods = c.mods
        x = DeviceInputs.from_host(self.round_inputs(seqs, c), self.device, mods=mods)
        if mods.penalties:                          # new slots: the prompt, no output yet
            counts = self.steps.eager.token_counts(self.max_batch_size, last.shape[-1])
            for s in seqs:
                if uses_penalties(s.params):
                    counts.reset(s.slot, s.prompt_ids)
                    if s.output_ids:                # resumed: its committed output
                        counts.add(self._tensor([s.slot]), self._tensor([s.output_ids]),
                                   self._tensor([[True] * len(s.output_ids)], torch.bool))
        if mods.any:
            last = self.steps.eager.modify(last[:, None], x, mods)[:, 0]
        first = torch.where(finite, plugins.sample_tokens(last, x.temperature, x.seed, lens), -1)
        fresh = self._tensor([not r for r in resumed], torch.bool)
        if mods.penalties:
            counts.add(x.slot, first[:, None], ((first >= 0) & fresh)[:, None])
        k = c.logprobs_k
        rows = None if k is None else to_host(*token_logprobs(raw[:, None], first[:, None], k))
        self._decide_during_prefill(len(self.running) + len(seqs))     # the prefill runs on the device
        for i, (s, t) in enumerate(zip(seqs, first.tolist())):
            self.running.append(s)
            if resumed[i]:                          # anchor and position as before the preemption
                if t < 0:
                    s.fail(NONFINITE_LOGITS)
                continue
            s.anchor, s.position = t, len(s.prompt_ids)
            if t < 0:
                s.fail(NONFINITE_LOGITS)
            else:
                s.commit([t], s.stop_ids(self.eos), rows, i)

    def _defers_prompts(self, seqs: list[Sequence], rows: int) -> bool:
        """Whether the draft context of these admitted prompts (``rows`` in all) waits in
        ``deferred`` for the batch's next speculative round: the batch is in an AR streak of the
        fallback (or, fresh, will start with one: ``_starts_with_ar``) and every admitted request
        would fall back with it (``scheduled``, no logprobs; no calibration run), within the
        deferred prompts' memory (``prompt_room``)."""
        return (self.speculative and self.defer_context and not self.record_confidence
                and all(s.params.verify_mode == "scheduled" and s.params.logprobs is None for s in seqs)
                and self.deferred.prompt_room(rows)
                and (self._ar_streak > 0 or self._starts_with_ar(self.running + seqs)))

    def _starts_with_ar(self, seqs: list[Sequence]) -> bool:
        """Whether a fresh batch (no speculative round yet: ``SurvivalEstimate.fresh``) of ``seqs``
        starts with AR rounds: its kind comes from the estimate (``_estimates_rounds``), which is
        the calibration's measured survival alone, and that says AR pays even at its upper bound as
        the prior's rows (``SurvivalEstimate.optimistic``: the calibration's temperature need not be
        the batch's). Not after finished requests emptied the window (``forget``): the first
        decision reads the start rule with the window's few rows, which drafts; estimating here,
        before the prefill is launched, cost every batch-1 admission 0.1-0.3 ms of host time
        (CPU), which ``_decide_during_prefill`` spends while the prefill runs."""
        return (self._survival.fresh and self._estimates_rounds(seqs)
                and self._scheduler().prefers_ar(len(seqs), self._survival.optimistic()))

    def _ar_round(self, seqs: list[Sequence], fallback: bool = False,
                  constants: BatchConstants | None = None) -> None:
        """Plain autoregressive step on the target: the comparison mode, or (``fallback``) an AR
        round inside speculative decoding, whose draft context waits in ``deferred`` for the
        next speculative round (``_write_deferred``) and which each request records as a round of
        0 verified drafts (never with logprobs: those batches do not fall back)."""
        c = constants or self.constants.get(seqs)
        mods, k, rows = c.mods, c.logprobs_k, None
        slots = [s.slot for s in seqs]
        self._round_kind = "ar"
        if k is None and fallback and self.defer_context:
            if not self.deferred.room_for(slots):
                self._write_deferred(seqs)
            r = self.round_inputs(seqs, c)
            r.tap_row = self.deferred.add(slots, [s.position for s in seqs])      # where the round stores its taps
            host = self.steps.ar_round_keep_taps(r, mods)                         # [B, 1]
        elif k is None:
            host = self.steps.ar_round(self.round_inputs(seqs, c), mods, context=fallback)   # [B, 1]
        else:
            host, rows = self.steps.eager.ar_round_logprobs(self.round_inputs(seqs, c), mods, k)
        for i, (s, (t,)) in enumerate(zip(seqs, host.tolist())):
            if t < 0:
                s.fail(NONFINITE_LOGITS)
                continue
            s.anchor, s.position = t, s.position + 1
            new = s.commit([t], s.stop_ids(self.eos), rows, i)
            if fallback:
                s.stats.record(0, len(new), 0)

    def _scheduler(self):
        return self.steps.eager.scheduler

    def _tracks_survival(self) -> bool:
        """Whether spec rounds feed the AR fallback's survival estimate (the scheduler may fall back)."""
        sched = self._scheduler()
        return sched is not None and sched.falls_back

    def _falls_back_to_ar(self, seqs: list[Sequence], estimates: bool) -> bool:
        """Whether this round of an all-``scheduled`` batch runs as an AR round (the scheduler's
        ``prefers_ar``: AR's tokens per ms against the best window's expected tokens per ms under
        the recent rounds' survival estimate at its upper bound, ``SurvivalEstimate.optimistic``:
        a streak starts only on evidence, not on a few unlucky rows; once started it goes on while
        AR stays within ``AR_STAY_MARGIN`` of the best window under the point estimate, ``curve``,
        so a probe's outcome ends it only where drafting is expected to pay); after ``AR_PROBE_EVERY`` AR rounds one
        scheduled round measures again, the interval doubling up to ``AR_PROBE_MAX`` while the
        probes confirm AR, and never shorter than the probes' budget allows: a probe that is
        expected to lose ``L`` AR rounds (``probe_loss``, its context write of the streak's
        deferred rows included, so priced again when it is due) comes after at least ``L /
        PROBE_BUDGET`` of them, at most ``AR_PROBE_LIMIT``. No probe at all while drafting cannot
        pay at the batch's row count even if every draft were accepted (``drafting_cannot_pay``: no
        probe's outcome could end the streak there). Deterministic: a function of the batch's
        history. Each decision inside a streak first ages the survival estimate's window by the
        streak's AR rounds since the last (``SurvivalEstimate.age``): a long streak's decisions
        read the history's prior and its probes, not the rounds from before it. ``estimates``: the
        round's ``_estimates_rounds``."""
        sched = self._scheduler()
        if not estimates:
            return False
        self._age_by_streak()              # the streak's AR rounds so far age the window
        if self._ar_streak >= max(self._probe_every, self._probe_floor) \
                and not sched.drafting_cannot_pay(len(seqs)):                # a probe is due ...
            loss = self._probe_loss(sched, seqs)
            if loss <= PROBE_BUDGET * self._ar_streak or self._ar_streak >= AR_PROBE_LIMIT:
                self._probing = True
                return False
            # ... but its context write of the streak's deferred rows grew past the budget: later
            self._probe_floor = min(AR_PROBE_LIMIT, math.ceil(loss / PROBE_BUDGET))
        if self._ar_streak > 0 or self._probing:       # a streak (or its probe's verdict): the point estimate
            ar = sched.prefers_ar(len(seqs), self._survival.curve(), AR_STAY_MARGIN)
        else:
            ar = sched.prefers_ar(len(seqs), self._survival.optimistic())
        if self._probing:                  # the probe confirmed AR: probe half as often (to 1/64)
            self._probe_every = min(2 * self._probe_every, AR_PROBE_MAX) if ar else AR_PROBE_EVERY
            self._probing = False
        if ar and self._ar_streak == 0:    # a streak starts (or goes on after a probe): its budget
            self._probe_floor = min(AR_PROBE_LIMIT, math.ceil(self._probe_loss(sched, seqs) / PROBE_BUDGET))
        return ar

    def _probe_loss(self, sched, seqs: list[Sequence]) -> float:
        """``sched.probe_loss`` of a speculative round of ``seqs`` now: the deferred rows it would
        write, and whether it would run as a confidence round (no head confidences seen yet)."""
        return sched.probe_loss(len(seqs), self._survival.curve(),
                                pending=self.deferred.pending_rows([s.slot for s in seqs]),
                                confidence_round=self._survival.last_confidence is None)

    def _estimates_rounds(self, seqs: list[Sequence], constants: BatchConstants | None = None) -> bool:
        """Whether this batch's round kind comes from the survival estimate (an all-``scheduled``
        batch, a cost curve with step latencies, an estimate; no calibration run, no logprobs:
        their rows come from the eager confidence rounds)."""
        sched, c = self._scheduler(), constants or self.constants.get(seqs)
        return not (sched is None or not sched.falls_back or self.record_confidence
                    or not self._survival.informed or not c.all_scheduled or c.logprobs_k is not None)

    def _estimated_window(self, seqs: list[Sequence], estimates: bool) -> int | None:
        """The verify window of this round of an all-``scheduled`` batch from the survival estimate
        (the scheduler's ``best_window``), or None where the round's own confidences choose it
        (no estimate, mixed modes, batches under ``ESTIMATED_WINDOW_MIN_ROWS`` rows, a scheduler
        that does not trim; under the packed model ``_packed_or_fixed``: each row its own prefix).
        N: a plain fixed round (trimming, or packing, would not pay for the head and the
        admission), which feeds the estimate too, uncensored.
        Under N: a window round (``_window_round``: the fixed round of the window's drafts, no
        head, no admission, no read-back), one in ``CONFIDENCE_PROBE_EVERY`` the confidence steps
        over that window. With many rows the window the round's confidences would give is close
        to the estimate's (it sums them over the rows), and the read-back stalls the device
        between the two steps."""
        sched = self._scheduler()
        if not estimates or sched.cost_model not in ("trimmed", "packed"):
            return None
        if sched.cost_model == "packed":
            return self._packed_or_fixed(sched)
        w = sched.best_window(len(seqs), self._survival.curve())
        return w if w == sched.num_spec_tokens or sched.estimates_windows(len(seqs)) else None

    def _packed_or_fixed(self, sched) -> int | None:
        """Packed model: None (a packed round) where the last confidence round's rows gain by
        ``TRIM_MARGIN`` from packing (``VerifyScheduler.packed_gain``, of the confidence round
        before the last: ``_refresh_packed_gain``), at least every
        ``PACKED_PROBE_EVERY`` rounds (a fresh look at the rows' confidences), else N (a fixed
        round: no head, no admission, no read-back)."""
        conf = self._survival.last_confidence
        if conf is not None and self._packed_gain[0] is None:   # the first: now (later: host work)
            self._refresh_packed_gain(sched)
        if conf is None or self._fixed_streak >= PACKED_PROBE_EVERY or self._packed_gain[1] > 1.0 + TRIM_MARGIN:
            self._fixed_streak = 0
            return None
        self._fixed_streak += 1
        return sched.num_spec_tokens

    def _refresh_packed_gain(self, sched) -> None:
        """``_packed_gain`` of the survival estimate's last confidences, once per confidence round
        (0.7 ms at 64 rows on 2 cores): in the host work of the round after it, while the device
        runs (``_next_decisions``), so the next round decides from the confidences of the round
        before its last one instead of computing it between two rounds, with the device idle."""
        conf = self._survival.last_confidence
        if conf is not None and self._packed_gain[0] is not conf:
            self._packed_gain = (conf, sched.packed_gain(conf))

    def _head_width(self, seqs: list[Sequence]) -> int | None:
        """The drafted width of this packed confidence round (``VerifyScheduler.head_width`` of
        the survival estimate), or None: all N (other cost models, a calibration run, no narrower
        width pays, or one round in ``HEAD_PROBE_EVERY`` of narrowed ones, whose head sees every
        position)."""
        sched = self._scheduler()
        if sched.cost_model != "packed" or self.record_confidence:
            return None
        if self._head_streak >= HEAD_PROBE_EVERY - 1:
            self._head_streak = 0
            return None
        h = sched.head_width(len(seqs), self._survival.curve())
        if h >= sched.num_spec_tokens:
            return None
        self._head_streak += 1
        return h

    def _window_round(self) -> bool:
        """Whether an estimated window (< N) runs as a window round (the fixed round of its
        drafts: no head, no admission, no read-back) rather than as a confidence round over it:
        all but one in ``CONFIDENCE_PROBE_EVERY``, whose head confidences keep the survival
        estimate's prior current (``SurvivalEstimate.prior``)."""
        if self.record_confidence or self._window_streak >= CONFIDENCE_PROBE_EVERY - 1 \
                or self._survival.last_confidence is None:
            self._window_streak = 0
            return False
        self._window_streak += 1
        return True

    def _streak_goes_on(self, batch: BatchConstants) -> bool:
        """Whether this round of an AR streak falls back again with nothing to decide: no probe is
        due and the decision's inputs are the last AR round's (the batch, so its rows and modes,
        and the survival curve, which no AR round changes). A streak's rounds are the fallback's
        common case, and on a round of ~0.3 ms (the default pair at batch 1, H100 host) the
        decision's calls cost as much as the rest of its host path above a plain AR round."""
        return (self._ar_streak > 0 and self._ar_streak < max(self._probe_every, self._probe_floor)
                and self._streak_inputs[0] is batch and self._streak_inputs[1] is self._survival.curve())

    def _spec_round(self, seqs: list[Sequence]) -> None:
        batch = self.constants.get(seqs)
        if self._streak_goes_on(batch):
            self._ar_streak += 1
            return self._ar_round(seqs, fallback=True, constants=batch)
        if (sched := self._scheduler()) is not None:
            sched.use_rows(len(seqs))                   # "auto": packed or trimmed by the round's rows
        estimates = self._estimates_rounds(seqs, batch)  # the round's decisions, host-side, once
        stay = self._ar_streak > 0 or self._probing      # the decision reads the curve, AR_STAY_MARGIN
        ready = self._ready_window(seqs, estimates, sched)
        if ready == UNDECIDED and self._falls_back_to_ar(seqs, estimates):
            self._ar_streak += 1
            if stay and getattr(sched, "round_costs", None) is None:   # (learned prices move every round)
                self._streak_inputs = (batch, self._survival.curve())    # the next rounds' decision, if these stay
            return self._ar_round(seqs, fallback=True, constants=batch)
        self._end_streak()
        self._flushed = self._write_deferred(seqs)
        mods, k, rows = batch.mods, batch.logprobs_k, None
        r = self.round_inputs(seqs, batch)
        if k is not None:                           # eager steps with logprob outputs
            self._round_kind = "logprobs"
            host, lims, rows = self.steps.eager.spec_round_logprobs(r, mods, k)
            lims, conf = (lims.tolist() if r.uses_confidence else [None] * len(seqs)), None
        elif (window := self._estimated_window(seqs, estimates) if ready == UNDECIDED else ready) \
                == self.nets.num_spec_tokens or not (r.uses_confidence or self.record_confidence):
            self._round_kind = "fixed"
            host = self.steps.spec_round(r, mods, host_work=self._next_decisions(seqs, estimates))   # [B, 2+N]
            lims, conf = [None] * len(seqs), None
        elif window is not None and self._window_round():       # the window's drafts, no head
            self._round_kind, self._round_width = "window", window
            host = self.steps.spec_round(r, mods, width=window, host_work=self._next_decisions(seqs, estimates))
            lims, conf = [window] * len(seqs), None
        else:                      # the fallback's estimate reads the head's confidences too
            admits = window is not None or self.steps.eager.needs_admission(r)
            track = self._tracks_survival() and admits
            # as spec_round_admitted runs it: the plain steps where nothing admits and nothing is read
            self._round_kind = "confidence" if admits or self.record_confidence else "fixed"
            head = self._head_width(seqs) if window is None and estimates else None
            if head is not None:     # its wall: not a "confidence" round's; its confidences (first `head`
                self._round_kind = "confidence_head"      # drafts) weigh its censored rows, not the prior
            host, lims, conf = self.steps.spec_round_admitted(r, mods, self.record_confidence or track, width=window,
                                                              host_work=self._next_decisions(seqs, estimates),
                                                              head=head)
            lims = lims.tolist()
            self._round_width = window or self._scheduler().verify_width(max(lims, default=0))
        for i, (s, (a, t, *x)) in enumerate(zip(seqs, host.tolist())):
            if a < 0:
                s.fail(NONFINITE_LOGITS)
                continue
            new = s.commit(x[:a] + [t], s.stop_ids(self.eos), rows, i)
            s.stats.record(a, len(new), lims[i])
            if conf is not None and self.record_confidence:
                n = s.stats.proposed[-1]          # verified drafts (cut at a stop token / the limit)
                if s.confidence is None:
                    s.confidence = []
                s.confidence.append((conf[i].tolist(), n, s.stats.accepted[-1]))
            s.anchor, s.position = t, s.position + a + 1
        live = [i for i, s in enumerate(seqs) if s.stats.committed and s.finish_reason is None]
        if live and self._tracks_survival():   # verified outcomes (rounds cut by a stop: left out)
            c = None if conf is None else self._scheduler().calibrated(np.asarray(conf)[live])
            self._survival.add([seqs[i].stats.accepted[-1] for i in live],       # a probe: read at once
                               [seqs[i].stats.proposed[-1] for i in live], c, now=self._probing,
                               defer=True)         # else taken in by the next round's host work

    def _next_decisions(self, seqs: list[Sequence], estimates: bool) -> Callable[[], None] | None:
        """Host work for the next round, run while this one's device work runs (``host_work`` of
        the steps): the survival estimate's refresh (``SurvivalEstimate.prepare``: it takes in the
        last round's outcome, which that round's ``add`` deferred, and the next round decides from
        the estimate of the rounds before this one) and the decisions it feeds
        (``prefers_ar``, ``best_window``: the scheduler's ``row_choices`` tables, every row count
        at once, so the next round reads its decisions even where its batch changed). On a
        round of ~1.5 ms (the default pair on the H200) they were 0.1-0.2 ms of its host path.
        Under the packed cost model also ``packed_gain`` of the confidences it took in
        (``_refresh_packed_gain``). A round that estimates nothing (fixed N) but feeds the estimate
        takes in the last round's deferred outcome (``SurvivalEstimate.flush``) the same way."""
        sched = self._scheduler()
        if not self._tracks_survival():
            return None
        if not estimates:
            return self._survival.flush

        def work() -> None:
            self._prepare_decisions(sched, len(seqs))
            if sched.cost_model == "packed":
                self._refresh_packed_gain(sched)     # what the next round's _packed_or_fixed reads
                sched.head_width(len(seqs), self._survival.curve())   # and its _head_width (cached)
        return work

    def _prepare_decisions(self, sched, rows: int) -> None:
        """The survival estimate (``prepare``) and the decision tables of both its curves."""
        self._survival.prepare()
        self._decision_tables(sched, rows)

    def _decision_tables(self, sched, rows: int) -> None:
        """The AR fallback's decisions of both curves of the survival estimate (``prefers_ar``:
        ``row_choices`` at every row count, the best windows with them), cached for the next round."""
        starts_ar = sched.prefers_ar(rows, self._survival.optimistic())
        sched.prefers_ar(rows, self._survival.curve(), AR_STAY_MARGIN)
        self._drafts_next = None if starts_ar else self._drafting_decision(sched, rows)

    def _drafting_decision(self, sched, rows: int) -> tuple | None:
        """The next round's decisions where it has ``rows`` rows, no AR streak runs, nothing they
        read changes before it (the survival curve, the cost curve, the trimmed cost model) and the
        start rule drafts (the caller's ``prefers_ar``; ``_falls_back_to_ar`` is then False and has
        no side effect): the window of ``_estimated_window`` -> (curve, rows, cost, window); None
        where prices are learned (they move every round)."""
        if sched.round_costs is not None or sched.cost_model != "trimmed":
            return None
        curve = self._survival.curve()
        w = sched.best_window(rows, curve)
        return curve, rows, sched.cost, (w if w == sched.num_spec_tokens or sched.estimates_windows(rows) else None)

    def _ready_window(self, seqs: list[Sequence], estimates: bool, sched) -> int | None:
        """The window of this round as the last host work decided it (``_drafting_decision``), where
        its inputs are still what it read, else ``UNDECIDED``: one check of the curve's identity in
        place of ``_falls_back_to_ar`` and ``_estimated_window`` on the round's path (H100, default
        pair at batch 1: ~0.007 ms of Python a round, the scheduled mode's fixed rounds 0.539-0.544
        ms at the median against fixed mode's 0.531-0.535; b9da358)."""
        d = self._drafts_next
        if (d is None or not estimates or self._ar_streak or self._probing or d[1] != len(seqs)
                or d[2] is not sched.cost or sched.cost_model != "trimmed" or d[0] is not self._survival.curve()):
            return UNDECIDED
        return d[3]

    def _decide_during_prefill(self, rows: int) -> None:
        """Host work while an admission's prefill runs: the survival curve and the decision
        tables the next round reads, where finished requests dropped them (``forget`` of a
        batch-sized share: at batch 1 every request), so they are not estimated on that round's
        path (CPU, default pair at batch 1 with the H100's prices: 0.1-0.3 ms once a request). The
        same estimate as the round's decision would make (no ``prepare``: a deferred outcome
        stays where it was)."""
        if self.speculative and self._tracks_survival() and self._survival.informed:
            self._decision_tables(self._scheduler(), rows)       # (cached where nothing dropped)

    def _write_deferred(self, seqs: list[Sequence]) -> bool:
        """The draft context that fallback AR rounds left pending for ``seqs``, in one call;
        whether there was any."""
        if self.deferred.empty:
            return False
        pending = [s for s in seqs if self.deferred.pending(s.slot)]
        if pending:
            self.deferred.flush([s.slot for s in pending], self._table(pending))
        return bool(pending)

    # ---- convenience ---------------------------------------------------------------------------
    def run(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        """Run a list of requests to completion; outputs in request order."""
        seqs = [self.add_request(p, sp) for p, sp in requests]
        while self.has_work():
            self.step()
        return [to_output(s) for s in seqs]


def to_output(s: Sequence) -> RequestOutput:
    return RequestOutput(s.request_id, s.prompt_ids, list(s.output_ids), s.finish_reason or "",
                         s.stats, error=s.error,
                         logprobs=None if s.logprobs is None and s.params.logprobs is None
                         else list(s.logprobs or []))
