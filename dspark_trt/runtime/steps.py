"""The decode steps of one round as fused functions over a networks object (eager reference).

A round is two steps, each a fixed-shape function of device tensors (so each can be captured as
one CUDA graph, see ``cuda_graphs.py``):

  draft_step   (anchor, start, table, temperature, seed)       -> drafts [B, N], z [B, N, V]
  verify_step  (+ drafts, z, top_p)                            -> out [B, 2 + N] = (accepted, next, drafts)
               target over [anchor, drafts] at P .. P+N, the modifiers, on-device acceptance, then
               the context injection of verify rows 0..a (rows > a at position -1: fixed shape N+1)
  ar_step      (anchor, start, table, temperature, top_p, seed) -> out [B, 1] = next token
               (the scheduler's AR fallback: also the anchors' taps, for a deferred context write)

Modifiers of the target distribution (``sampling_modifiers.py``: penalties, top-k, min-p, top-p)
are applied to the target logits of every verify row (and the AR step's) before acceptance, each
only when the round's ``Modifiers`` flag says some row uses it; with penalties the steps read and
update the per-slot token counts ``DecodeSteps.counts`` (committed drafts + next token, in place).

Confidence modes (``confidence.py``): a row verifies only an admitted prefix of ``l`` drafts
(``limit``). Two steps of the same shapes as the fixed round:

  draft_admit_step  (+ verify_mode, threshold)  -> drafts, z, confidence logits [B, N], limit [B]
                    the draft step with the confidence head, then ``admitted_lengths`` on the device
  verify_admit_step (+ drafts, z, limit, top_p, width w) -> out [B, 3 + w] = (accepted, next,
                    drafts[:, :w], limit): the verify of the first w >= max l drafts of every row
                    (the target is causal, so row ``l``'s logits do not depend on the drafts after
                    it), acceptance clamped to ``l``, and a row that accepts all its ``l`` drafts
                    takes its next token from the target row ``l`` (a bonus: argmax, or a sample of
                    ``p_l`` with the RESIDUAL stream at ``P + l + 1``): exactly speculative sampling
                    of an ``l``-token proposal.

The window: ``w = N`` under the scheduler's "padded" cost model (no host synchronisation between
the steps: the fixed round's two launches plus the head and the admission's small kernels); under
"trimmed" (the default) the round reads ``max l`` back after the draft step and verifies
``w = scheduler.verify_width(max l)`` drafts (one graph per width bucket), so a batch of low
confidence runs a narrower, cheaper verify. ``verify_widths`` counts the windows run. A window
chosen before the round (the scheduler's survival estimate, from ``ESTIMATED_WINDOW_MIN_ROWS``
rows) runs as a *window round*: ``spec_round(r, mods, width=w)``, the fixed round of the first w
drafts (the draft's block pass over all N positions, its head and Markov sampler over w rows, the
verify of w), with no head, no admission and no read-back; ``window_rounds`` counts them. Under
"packed" each row verifies its own admitted prefix, the rows' window tokens packed end to end
(``packed_verify.py``) into ``scheduler.verify_slots(sum (1 + l))`` slots (one graph per slot
bucket, read back like the trimmed window); ``verify_slots`` counts the slot buckets run.

The public round interface (every caller drives a round through it, never through private parts):
  ``Scheduler.round_inputs(seqs)``             the ``RoundInputs`` of running sequences
  ``steps.spec_round / spec_round_admitted / ar_round(r, ...)``  one round, host in, host out
  ``steps.ar_round_keep_taps(r, mods)``        an AR round that also stores its taps in the steps'
                                               ``tap_store`` at rows ``r.tap_row`` (the fallback's)
  ``steps.eager.spec_round_logprobs / ar_round_logprobs(r, mods, k)``  the same, eager, with the
                                               raw target logprobs of the emitted tokens (top k)
  ``steps.stage(r)`` -> ``StagedRound``        the round's device inputs and one callable per step
                                               (eager calls, or graph replays on ``GraphedSteps``):
                                               what bench and profiling time
  ``steps.replayable(fn)``                     fn as it would run in a round (a CUDA graph of it on
                                               ``GraphedSteps``, fn itself here)
  ``steps.eager``                              the eager ``DecodeSteps`` under either
  ``verify_window(x, drafts)``                 the target's verify input: tokens and positions

The context injection ends the verify step (rather than starting the next draft step) so that no
device state is carried between rounds: rows may join, leave or reorder freely between rounds.
Rows with ``start < 0`` are inert (they write nothing and return -1 / 0 accepted).
A live row whose target logits hold NaN or Inf returns accepted = -1 (verify) or token -1 (AR):
one read of the logits per step (``plugins.rows_finite``), read back with the tokens.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .. import plugins
from .confidence import MODE_IDS
from .context_rows import ContextRows
from .logprobs import LogprobRows, emitted_tokens, to_host, token_logprobs
from .packed_verify import check_packable, packed_target
from .sampling_modifiers import Modifiers, TokenCounts, apply_modifiers


# modifier field -> (neutral / inert value, dtype)
MODIFIER_FIELDS = {"top_k": (0, np.int64), "slot": (-1, np.int64), "min_p": (0.0, np.float32),
                   "presence_penalty": (0.0, np.float32), "frequency_penalty": (0.0, np.float32),
                   "repetition_penalty": (1.0, np.float32)}


@dataclass
class RoundInputs:
    """Host-side (numpy) inputs of one round for B rows."""

    anchor: np.ndarray        # [B] int64: last committed token (its target KV is not written yet)
    start: np.ndarray         # [B] int64: P, the anchor's position
    seed: np.ndarray          # [B] int64
    temperature: np.ndarray   # [B] float32
    top_p: np.ndarray         # [B] float32
    table: np.ndarray         # [B, max_pages] int64 page ids, -1 padded
    verify_mode: np.ndarray | None = None   # [B] int64 ``confidence.MODE_IDS`` (None: all fixed)
    threshold: np.ndarray | None = None     # [B] float32 (threshold rows)
    # the modifiers (``sampling_modifiers.py``), ``MODIFIER_FIELDS``; None: neutral on every row
    top_k: np.ndarray | None = None         # [B] int64 (<= 0: off)
    min_p: np.ndarray | None = None         # [B] float32
    presence_penalty: np.ndarray | None = None    # [B] float32
    frequency_penalty: np.ndarray | None = None   # [B] float32
    repetition_penalty: np.ndarray | None = None  # [B] float32
    slot: np.ndarray | None = None          # [B] int64: the row's ``TokenCounts`` slot (-1: none)
    tap_row: np.ndarray | None = None       # [B] int64: ``tap_store`` row of its taps (-1 / None: spare row)

    def modifier(self, name: str) -> np.ndarray:
        """The modifier field ``name`` [B] (its neutral value on every row when None)."""
        value, dtype = MODIFIER_FIELDS[name]
        a = getattr(self, name)
        return np.full(self.batch_size, value, dtype) if a is None else np.asarray(a, dtype)

    @property
    def uses_confidence(self) -> bool:
        return self.verify_mode is not None and bool((self.verify_mode != 0).any())

    def head(self, B: int) -> "RoundInputs":
        """The first B rows."""
        return replace(self, **{f.name: v[:B] for f in fields(self) if (v := getattr(self, f.name)) is not None})

    @property
    def batch_size(self) -> int:
        return int(self.anchor.shape[0])


@dataclass
class DeviceInputs:
    """The same inputs as device tensors (views into one static buffer on the graph path)."""

    anchor: Tensor
    start: Tensor
    seed: Tensor
    temperature: Tensor
    top_p: Tensor
    table: Tensor
    verify_mode: Tensor | None = None   # [B] int64 ``confidence.MODE_IDS`` (confidence rounds)
    threshold: Tensor | None = None     # [B] f32
    top_k: Tensor | None = None         # [B] int64; the modifiers (``MODIFIER_FIELDS``)
    min_p: Tensor | None = None         # [B] f32
    presence_penalty: Tensor | None = None    # [B] f32
    frequency_penalty: Tensor | None = None   # [B] f32
    repetition_penalty: Tensor | None = None  # [B] f32
    slot: Tensor | None = None          # [B] int64
    tap_row: Tensor | None = None       # [B] int64

    @classmethod
    def from_host(cls, r: RoundInputs, device, confidence: bool = False,
                  mods: Modifiers | bool | None = None) -> "DeviceInputs":
        """``confidence``: also the verify modes and thresholds (``draft_admit_step``); ``mods``
        using any modifier: also the modifier fields."""
        t = lambda a: torch.tensor(a, device=device)  # noqa: E731  (a copy: the arrays may be read-only, shared)
        mode, thr = confidence_inputs(r, device) if confidence else (None, None)
        extra = ({f: t(r.modifier(f)) for f in MODIFIER_FIELDS} if Modifiers.of(mods).any else {})
        return cls(t(r.anchor), t(r.start), t(r.seed), t(r.temperature), t(r.top_p), t(r.table),
                   mode, thr, **extra, tap_row=None if r.tap_row is None else t(r.tap_row))

    def head(self, B: int) -> "DeviceInputs":
        """The first B rows (the fixed-round fields, and the verify modes / thresholds if present;
        no modifiers)."""
        cut = lambda v: None if v is None else v[:B]  # noqa: E731
        return DeviceInputs(self.anchor[:B], self.start[:B], self.seed[:B], self.temperature[:B],
                            self.top_p[:B], self.table[:B], cut(self.verify_mode), cut(self.threshold))


def verify_window(x: DeviceInputs, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """The verify step's target input for the w = drafts.shape[1] drafts given: tokens
    [anchor, drafts] [B, w+1] at positions P .. P+w (-1 on inert rows) [B, w+1]."""
    offs = torch.arange(drafts.shape[1] + 1, device=x.start.device)
    pos = torch.where((x.start >= 0)[:, None], x.start[:, None] + offs, -1)
    return torch.cat([x.anchor[:, None], drafts], 1), pos


@dataclass
class StagedRound:
    """One fixed round staged on the device (``DecodeSteps.stage`` / ``GraphedSteps.stage``):
    ``x`` its inputs, ``drafts`` / ``z`` the draft step's outputs that the verify step reads, and
    ``draft`` / ``verify`` / ``ar``: each runs that step again on ``x`` (greedy acceptance, no
    modifiers): eager calls, or graph replays (then ``x`` holds the bucket's rows). For timing and
    profiling: the verify step writes the draft context as in a round. Without a draft (N = 0):
    ``drafts`` [B, 0], ``z``, ``draft`` and ``verify`` None."""

    x: DeviceInputs
    drafts: Tensor
    z: Tensor | None
    draft: Callable[[], object] | None
    verify: Callable[[], object] | None
    ar: Callable[[], object]


class DecodeSteps:
    """The fused steps over ``networks`` (EagerNetworks or an engine with the same interface)."""

    def __init__(self, networks, scheduler=None):
        """``scheduler``: a ``verify_scheduler.VerifyScheduler`` (needed for the confidence modes)."""
        self.nets = networks
        self.device = networks.device
        self.num_spec_tokens = networks.num_spec_tokens
        self.scheduler = scheduler
        self.counts: TokenCounts | None = None        # the penalties' per-slot token counts
        self.verify_widths: Counter = Counter()       # confidence rounds per verify window
        self.verify_slots: Counter = Counter()        # packed confidence rounds per slot count
        self.window_rounds: Counter = Counter()       # window rounds (w < N drafts, no head) per w
        # the AR fallback's taps (``deferred_context.py``), written by its AR rounds at ``tap_row``:
        # [tap_rows + 1, m*d] (the last row takes inert rows), allocated by the first such step
        self.tap_rows = 0
        self.tap_store: Tensor | None = None
        self.context_rows = ContextRows(networks)     # their late write (eager; GraphedSteps: graphs)

    def reserve_taps(self, rows: int) -> None:
        """``tap_store`` rows for at least ``rows`` taps (``DeferredContext``: slots x capacity); a
        larger reservation replaces the store at the next step that keeps taps (``GraphedSteps``
        keys the graph of that step by ``tap_rows``: a new store, a new capture)."""
        if rows > self.tap_rows:
            self.tap_rows, self.tap_store = rows, None

    def keep_taps(self, taps: Tensor, rows: Tensor | None) -> None:
        """``taps [B, m*d]`` into ``tap_store`` at ``rows [B]`` (-1, or ``rows`` None: the spare
        last row): one scatter kernel inside the step, which a CUDA graph replays with the round's
        rows (-1 indexes the spare row as it wraps)."""
        if self.tap_store is None or self.tap_store.shape[-1] != taps.shape[-1]:
            self.tap_store = taps.new_empty(self.tap_rows + 1, taps.shape[-1])
        if rows is None:
            rows = torch.full_like(taps[:, 0], -1, dtype=torch.int64)
        self.tap_store.index_put_((rows,), taps)

    def token_counts(self, slots: int, vocab: int) -> TokenCounts:
        """The penalties' device state with at least ``slots`` slots (allocated on first use; a
        larger request replaces it, and ``GraphedSteps`` recaptures its penalty graphs)."""
        if self.counts is None or self.counts.slots < slots or self.counts.vocab != vocab:
            self.counts = TokenCounts(slots, vocab, self.device)
        return self.counts

    def modify(self, logits: Tensor, x: DeviceInputs, mods: Modifiers, block: Tensor | None = None
               ) -> Tensor:
        """``sampling_modifiers.apply_modifiers`` over this steps' token counts."""
        if mods.penalties and self.counts is None:
            raise RuntimeError("penalties need the token counts (DecodeSteps.token_counts)")
        return apply_modifiers(logits, x, mods, self.counts, block)

    @property
    def eager(self) -> "DecodeSteps":
        """The eager steps (itself; ``GraphedSteps.eager`` is the ``DecodeSteps`` it replays)."""
        return self

    def replayable(self, fn: Callable[[], object]) -> Callable[[], object]:
        """fn as it runs in a round: eagerly (``GraphedSteps.replayable``: a CUDA graph of it)."""
        return fn

    def stage(self, r: RoundInputs) -> StagedRound:
        """The round ``r`` on the device, its draft step run once (see ``StagedRound``)."""
        x = DeviceInputs.from_host(r, self.device)
        ar = lambda: self.ar_step(x, False)  # noqa: E731
        if not self.num_spec_tokens:                              # no draft: the AR step only
            return StagedRound(x, x.anchor[:, None][:, :0], None, None, None, ar)
        drafts, z = self.draft_step(x)
        return StagedRound(x, drafts, z, lambda: self.draft_step(x),
                           lambda: self.verify_step(x, drafts, z, False), ar)

    # ---- the steps (device tensors in, device tensors out; no host synchronisation) -------------
    @torch.inference_mode()
    def draft_step(self, x: DeviceInputs, width: int | None = None) -> tuple[Tensor, Tensor]:
        """Draft block + Markov sampler -> drafts [B, N] i64, proposal logits z [B, N, V] f32;
        with ``width`` < N only the first ``width`` drafts ([B, w], [B, w, V])."""
        if width is None or width == self.num_spec_tokens:
            return self.nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed)
        return self.nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed, width=width)

    @torch.inference_mode()
    def draft_step_confidence(self, x: DeviceInputs, head: int | None = None, z_out: Tensor | None = None
                              ) -> tuple[Tensor, Tensor, Tensor]:
        """The draft step with the confidence head -> drafts, z, confidence logits [B, h] f32 of the
        first ``head`` (None: all N) drafts (the block pass is the N-token one; the LM head, the
        sampler and the confidence head run on h rows); ``z_out``: a [B, h, V] buffer for z."""
        kw = ({} if head is None or head == self.num_spec_tokens else {"width": head}) | (
            {} if z_out is None else {"z_out": z_out})
        return self.nets.draft_block_confidence(x.anchor, x.start, x.table, x.temperature, x.seed, **kw)

    @torch.inference_mode()
    def admit(self, x: DeviceInputs, conf: Tensor, mode: Tensor, threshold: Tensor) -> Tensor:
        """Admitted drafts per row [B] int64 (``confidence.admitted_lengths``)."""
        if self.scheduler is None:
            raise RuntimeError("confidence modes need a VerifyScheduler (DecodeSteps(..., scheduler=))")
        return self.scheduler.admit(conf, x.start >= 0, mode, threshold)

    @torch.inference_mode()
    def draft_admit_step(self, x: DeviceInputs, head: int | None = None, z_out: Tensor | None = None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The draft step with the confidence head (of the first ``head`` drafts; z into ``z_out``),
        then the admission of ``x.verify_mode`` / ``x.threshold`` -> drafts, z, confidence logits
        [B, h] f32, limit [B] int64 (<= h)."""
        drafts, z, conf = self.draft_step_confidence(x, head, z_out)
        return drafts, z, conf, self.admit(x, conf, x.verify_mode, x.threshold)

    @torch.inference_mode()
    def verify_admit_step(self, x: DeviceInputs, drafts: Tensor, z: Tensor, limit: Tensor,
                          mods: Modifiers | bool, width: int | None = None,
                          slots: int | None = None) -> Tensor:
        """``verify_step`` of the first ``width`` (default all N) drafts with ``limit`` (every
        ``limit <= width``) -> [B, 3 + width] (accepted, next, drafts[:, :width], limit): the
        round's host read-back in one tensor. ``slots``: the packed verify of ``slots`` tokens
        (``packed_verify.py``: each row's own admitted prefix only)."""
        w = drafts.shape[1] if width is None else width
        d, zw = drafts[:, :w].contiguous(), z[:, :w].contiguous()
        # the window's w+1 target rows are computed for every row: a scheduled row verifies all
        # of them (its admission chose the window; a shorter prefix would only lose tokens), but
        # under the "packed" cost model, which prices each row's own prefix (tests)
        if self.scheduler is None or self.scheduler.cost_model != "packed":
            sched = (x.verify_mode == MODE_IDS["scheduled"]) & (x.start >= 0)
            limit = torch.where(sched, w, limit)
        return torch.cat([self.verify_step(x, d, zw, mods, limit, slots=slots), limit[:, None]], 1)

    def shape(self, x: DeviceInputs, limit: Tensor, head: int | None = None) -> tuple[int, int | None]:
        """(width, slots) of the verify of a confidence round with admitted lengths ``limit`` [B]
        (device) of ``head`` (None: N) drafted: (head, None), or under a trimming / packing
        scheduler its ``verify_shape`` of the live rows' lengths (one host read-back)."""
        if self.scheduler is None or not self.scheduler.trims:
            return head or self.num_spec_tokens, None
        if self.scheduler.packs:
            check_packable(self.nets)
        return self.scheduler.verify_shape(limit[x.start >= 0].cpu().numpy(), x.start.shape[0], head)

    @torch.inference_mode()
    def verify_step(self, x: DeviceInputs, drafts: Tensor, z: Tensor, mods: Modifiers | bool,
                    limit: Tensor | None = None, logprobs: int | None = None, slots: int | None = None):
        """Target verify + acceptance + context injection -> [B, 2 + w] (accepted, next, drafts)
        for the w = drafts.shape[1] drafts given; ``mods``: the modifiers to apply (a bool: top-p
        or none); ``limit`` [B] (optional): each row verifies only its first ``limit`` drafts
        (exact; see the module docstring). ``logprobs`` = k (eager only): also the raw target
        logprobs of the token each row emits and its top k, ``(out, (chosen [B, N+1], ids, vals))``
        (``logprobs.py``). ``slots`` (with ``limit``): the target runs packed, over each row's
        ``1 + limit`` window tokens only, in ``slots`` slots (``packed_verify.py``)."""
        mods = Modifiers.of(mods)
        N = drafts.shape[1]
        offs = torch.arange(N + 1, device=x.start.device)
        tokens, pos = verify_window(x, drafts)                                    # [B, N+1]
        if slots is None:
            logits, taps = self.nets.target(tokens, pos, x.table)
            finite = plugins.rows_finite(logits)                                  # [B]
        else:
            lengths = torch.where(x.start >= 0, 1 + limit.clamp(max=N), 0)       # [B]
            logits, taps, finite = packed_target(self.nets.target, tokens, pos, x.table, lengths, slots)
        raw = logits
        if mods.any:                                # row j counts the drafts before it
            logits = self.modify(logits, x, mods, drafts)
        accepted, nxt = self.nets.verify(logits, drafts, z, x.temperature, x.seed, x.start)
        if limit is not None:
            lim = limit.clamp(max=N)
            full = accepted >= lim                       # every admitted draft passed: bonus at row l
            row = logits.gather(1, lim[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
            bonus = plugins.sample_tokens(row, x.temperature, x.seed, x.start + lim + 1)
            accepted = torch.where(full, lim, accepted)
            nxt = torch.where(full & (x.start >= 0), bonus, nxt)
        if mods.penalties:                          # the committed drafts and next token [B, N+1]
            self.counts.add(x.slot, torch.cat([drafts, nxt[:, None]], 1),
                            torch.cat([offs[None, :N] < accepted[:, None], (nxt >= 0)[:, None]], 1))
        ctx_pos = torch.where(offs[None, :] <= accepted[:, None], pos, -1)          # [B, N+1]
        self.nets.draft_context(taps, ctx_pos, x.table)
        flagged = torch.where(finite, accepted, -1)                                 # -1: not finite
        out = torch.cat([flagged[:, None], nxt[:, None], drafts], 1)
        if logprobs is None:
            return out
        return out, token_logprobs(raw, emitted_tokens(drafts, nxt, accepted), logprobs)

    @torch.inference_mode()
    def ar_step(self, x: DeviceInputs, mods: Modifiers | bool, context: bool = False,
                logprobs: int | None = None, taps_out: bool = False, keep_taps: bool = False):
        """One autoregressive target step -> next token [B, 1] (-1 for inert rows). ``context``:
        also write the draft's context at the anchor's position from the target's taps (what a
        verify that accepted no draft writes), so that a speculative round can follow.
        ``taps_out``: ``(next, taps [B, m*d])`` instead, the taps of the anchor's position for a
        later write; ``keep_taps``: those taps stored in ``tap_store`` at rows ``x.tap_row`` (the AR
        rounds of the scheduler's fallback, ``deferred_context.py``). With
        ``logprobs`` = k (eager only) ``(next, (chosen [B, 1], ids, vals))`` as ``verify_step``."""
        mods = Modifiers.of(mods)
        pos = torch.where(x.start >= 0, x.start, -1)[:, None]                       # [B, 1]
        logits, taps = self.nets.target(x.anchor[:, None], pos, x.table)
        if context:
            self.nets.draft_context(taps, pos, x.table)
        raw = logits
        finite = plugins.rows_finite(logits)                                        # [B]
        if mods.any:
            logits = self.modify(logits, x, mods)
        nxt = plugins.sample_tokens(logits[:, 0], x.temperature, x.seed, x.start + 1)
        nxt = torch.where((x.start >= 0) & finite, nxt, -1)[:, None]                # [B, 1]
        if mods.penalties:
            self.counts.add(x.slot, nxt, nxt >= 0)
        if keep_taps:
            self.keep_taps(taps[:, 0], x.tap_row)
        if taps_out:
            return nxt, taps[:, 0]
        return nxt if logprobs is None else (nxt, token_logprobs(raw, nxt, logprobs))

    @torch.inference_mode()
    def prefill_step(self, tokens: Tensor, positions: Tensor, table: Tensor, lens: Tensor,
                     context: bool, keep_taps: bool = False):
        """The admission prefill: the target over right-padded prompts ``tokens`` / ``positions``
        [B, T] (pad position -1) and, with ``context``, the draft's context of every prompt row
        -> the target logits of each row's last prompt token (row ``lens - 1``) [B, V];
        ``keep_taps``: ``(logits, taps [B, T, m*d])``, the prompt's taps for a later draft-context
        write (``deferred_context.py``)."""
        logits, taps = self.nets.target(tokens, positions, table)
        if context:
            self.nets.draft_context(taps, positions, table)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        last = logits[rows, (lens - 1).clamp(min=0)]
        return (last, taps) if keep_taps else last

    def prefill(self, tokens: Tensor, positions: Tensor, table: Tensor, lens: Tensor,
                context: bool, keep_taps: bool = False):
        """``prefill_step`` (``GraphedSteps.prefill``: a CUDA graph per padded shape)."""
        return self.prefill_step(tokens, positions, table, lens, context, keep_taps)

    # ---- one round from host inputs to host outputs (the single synchronisation) ----------------
    def spec_round(self, r: RoundInputs, mods: Modifiers | bool, width: int | None = None,
                   host_work: Callable[[], None] | None = None) -> np.ndarray:
        """-> [B, 2 + N] int64 on the host: accepted (-1: non-finite logits), next token, drafts.
        ``width`` < N: a window round, the fixed round of the first ``width`` drafts (drafts past
        it come back as -1; no head, no admission, no read-back between the steps).
        ``host_work``: called once the round's device work is queued, before its read-back waits
        for it (the caller's host work for the next round, hidden behind this one)."""
        x = DeviceInputs.from_host(r, self.device, mods=mods)
        drafts, z = self.draft_step(x, width)
        if width is not None and width < self.num_spec_tokens:
            self.window_rounds[width] += 1
        out = self.verify_step(x, drafts, z, mods)
        run_host_work(host_work)
        return widen(out.cpu().numpy(), self.num_spec_tokens)

    def needs_admission(self, r: RoundInputs) -> bool:
        """Whether round ``r`` runs the confidence steps (head + admission): some row has a
        confidence mode that can admit fewer than N drafts (``VerifyScheduler.admits_every_draft``)."""
        return r.uses_confidence and (self.scheduler is None
                                      or not self.scheduler.admits_every_draft(r.verify_mode))

    def spec_round_admitted(self, r: RoundInputs, mods: Modifiers | bool, want_confidence: bool = False,
                            width: int | None = None, host_work: Callable[[], None] | None = None,
                            head: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """-> (as ``spec_round``: [B, 2 + N]; admitted drafts per row [B]; the confidence logits
        [B, N] when ``want_confidence``, else None). Rounds with a confidence mode (or
        ``want_confidence``, or a ``width``) run ``draft_admit_step`` + ``verify_admit_step`` over
        the window of ``shape(x, limit)`` (drafts past it come back as -1), or over ``width`` drafts
        when the caller chose the window ahead (``Scheduler``'s estimated window: no read-back of
        the admitted lengths between the steps); rounds that admit every draft
        (``needs_admission``) run the plain steps. ``host_work``: as in ``spec_round``. ``head``
        (< N, without ``width``): only the first ``head`` drafts are sampled, scored and admitted
        (``VerifyScheduler.head_width``); the confidence logits come back [B, head]."""
        N = self.num_spec_tokens
        if width is None and not (self.needs_admission(r) or want_confidence):
            return self.spec_round(r, mods, host_work=host_work), np.where(r.start >= 0, N, 0), None
        x = DeviceInputs.from_host(r, self.device, confidence=True, mods=mods)
        drafts, z, conf, limit = self.draft_admit_step(x, None if width is not None else head)
        w, slots = self.shape(x, limit, head) if width is None else (width, None)
        self.verify_widths[w] += 1
        if slots is not None:
            self.verify_slots[slots] += 1
        out = self.verify_admit_step(x, drafts, z, limit, mods, w, slots)
        run_host_work(host_work)
        out = out.cpu().numpy()
        return widen(out[:, :-1], N), out[:, -1], conf.cpu().numpy() if want_confidence else None

    def spec_round_logprobs(self, r: RoundInputs, mods: Modifiers | bool, k: int
                            ) -> tuple[np.ndarray, np.ndarray, LogprobRows]:
        """``spec_round_admitted`` (eager) with the raw target logprobs of the emitted tokens and
        their top ``k`` -> (host [B, 2 + N], admitted drafts [B], ``LogprobRows`` [B, N+1])."""
        N = self.num_spec_tokens
        if self.needs_admission(r):
            x = DeviceInputs.from_host(r, self.device, confidence=True, mods=mods)
            drafts, z, _conf, limit = self.draft_admit_step(x)
            out, lp = self.verify_step(x, drafts, z, mods, limit, logprobs=k)
            limits = limit.cpu().numpy()
        else:
            x = DeviceInputs.from_host(r, self.device, mods=mods)
            drafts, z = self.draft_step(x)
            out, lp = self.verify_step(x, drafts, z, mods, logprobs=k)
            limits = np.where(r.start >= 0, N, 0)
        return out.cpu().numpy(), limits, to_host(*lp)

    def ar_round_logprobs(self, r: RoundInputs, mods: Modifiers | bool, k: int
                          ) -> tuple[np.ndarray, LogprobRows]:
        """``ar_round`` (eager) with logprobs -> (next [B, 1], ``LogprobRows`` [B, 1])."""
        nxt, lp = self.ar_step(DeviceInputs.from_host(r, self.device, mods=mods), mods, logprobs=k)
        return nxt.cpu().numpy(), to_host(*lp)

    def ar_round(self, r: RoundInputs, mods: Modifiers | bool, context: bool = False) -> np.ndarray:
        """-> [B, 1] int64 on the host: the next token (-1: non-finite logits); ``context``: see
        ``ar_step``."""
        return self.ar_step(DeviceInputs.from_host(r, self.device, mods=mods), mods,
                            context).cpu().numpy()

    def ar_round_keep_taps(self, r: RoundInputs, mods: Modifiers | bool) -> np.ndarray:
        """-> next token [B, 1] on the host as ``ar_round``; the anchors' taps go to ``tap_store``
        at rows ``r.tap_row`` (``ar_step(keep_taps=True)``)."""
        return self.ar_step(DeviceInputs.from_host(r, self.device, mods=mods), mods,
                            keep_taps=True).cpu().numpy()


def run_host_work(work: Callable[[], None] | None) -> None:
    """A round's ``host_work``, run while its device work is queued (before the read-back)."""
    if work is not None:
        work()


def widen(out: np.ndarray, n: int) -> np.ndarray:
    """A round's host output [B, 2 + w] padded with -1 drafts to [B, 2 + n]."""
    if out.shape[1] == 2 + n:
        return out
    return np.concatenate([out, np.full((out.shape[0], 2 + n - out.shape[1]), -1, out.dtype)], 1)


def confidence_inputs(r: RoundInputs, device) -> tuple[Tensor, Tensor]:
    """(mode [B] int64, threshold [B] f32) device tensors of a round (fixed rows when absent)."""
    B = r.batch_size
    mode = r.verify_mode if r.verify_mode is not None else np.zeros(B, np.int64)
    thr = r.threshold if r.threshold is not None else np.zeros(B, np.float32)
    return (torch.tensor(mode, dtype=torch.int64, device=device),
            torch.tensor(thr, dtype=torch.float32, device=device))
