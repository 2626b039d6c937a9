"""The host side of the scheduled mode (``VerifyScheduler``): the verify cost models, the
calibration and cost tables bound to a device for the admission, and the round decisions priced by
the cost curve (trimmed window, head width, AR fallback).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..config.source import VERIFY_COST_MODELS
from .confidence import MODE_IDS, Calibration, admitted_lengths
from .cost_curve import CostCurve
from .packed_verify import token_buckets
from .round_costs import RoundCosts

COST_MODELS = VERIFY_COST_MODELS
PACKED_MIN_ROWS = 48          # "auto": rounds of this many rows or more run the packed model, fewer the trimmed
                              # one. H100, Qwen3-8B dimensions, steady load (session 37, faaf31b / 0d5294b):
                              # packed / fixed 1.16-1.18 at 64 rows against the trimmed model's 1.08-1.13,
                              # 1.01-1.02 at 32 (trimmed 1.00-1.02), 0.99 at 8-16, 0.93-0.95 at 1; between
                              # 32 and 64 unmeasured: the threshold sits between them, below the 60-63
                              # rows a steady load of 64 decodes in the rounds where requests finish
ROUND_OVERHEAD_MS = 1.3       # host time of a round outside its steps, AR or speculative alike, where the
                              # cost curve has no ``host_ms`` (H200, a8f3096, eager steps: end-to-end
                              # round_ms - the curve's steps, batch 1)
SCHEDULER_ROW_MS = 0.01       # with ``host_ms``: the Scheduler's own Python per row and round (commit,
                              # round inputs; H200 3599eb9, compiled steps: steady-load decode round
                              # minus the timed fixed round, 0.35 ms at 16 rows, 0.63 ms at 64)
AR_MARGIN = 0.05               # the AR fallback starts a streak where AR is this much faster than the best
                               # window under the estimate's upper bound (``SurvivalEstimate.optimistic``)
AR_STAY_MARGIN = -0.05         # and keeps it while AR is within this of the best window under the point
                               # estimate (``curve``): a band between the two in which the batch stays the kind
                               # it is. Without it a streak ended whenever the upper bound of a few dozen rows
                               # crossed AR (H100, default pair, batch 1 at 6770686: AR rounds 0.29 ms, fixed
                               # 0.76 with tau 2.0, and 86 fixed rounds beside 213 AR ones: 0.89-0.91x AR)
TRIM_MARGIN = 0.05             # a trimmed window must beat the fixed round by this much: what the curve
                               # misses of a window round's cost under load (H200 cb44cdd: narrow 64-row
                               # rounds ~2 % over the curve, a tie lost 4 %; ee24758, steady load, 32
                               # rows: window rounds 10.22 ms, fixed 12.44, isolated 9.38 / 12.24; with
                               # 0.02 the 32-row windows ran 0.95-0.99x fixed, 63e95a1 / ee24758)
ADMISSION_OVERHEAD_MS = 0.25     # head + admission + the width read-back (H200, 5a26239: 6-18 % of a 1-2 ms round)
ESTIMATED_WINDOW_MIN_ROWS = 8    # from this many rows a trimmed window comes from the survival estimate
                                 # and runs as a window round (no head, admission or read-back) ...
CONFIDENCE_PROBE_EVERY = 8       # ... but every this many such rounds one runs the confidence steps over
                                 # the window (the head's prefix products: the estimate's prior)
HEAD_MARGIN = 0.01               # a packed round drafts fewer than N (``head_width``) where that is priced this
                                 # much better than drafting all N
HEAD_PROBE_EVERY = 8             # and one in this many such rounds drafts all N: the survival estimate sees the
                                 # positions past the head (and the head's confidences of them) only then


def width_buckets(n: int) -> list[int]:
    """The verify widths a trimmed round runs (one CUDA graph each): 1 .. n for n <= 8, else the
    powers of two below n and n."""
    if n <= 8:
        return list(range(1, n + 1))
    return [w for w in (1 << i for i in range(n.bit_length())) if w < n] + [n]


@dataclass(frozen=True)
class RowChoices:
    """``VerifyScheduler.row_choices``: per row count r (index r), for one survival curve."""
    ar_rate: np.ndarray        # [R + 1] an AR round's tokens per ms per row (1 / its price)
    best_rate: np.ndarray      # [R + 1] the best window's expected tokens per ms per row
    window: np.ndarray         # [R + 1] int: ``best_window``


class VerifyScheduler:
    """Calibration + cost table bound to a device; ``admit`` is ``admitted_lengths``.

    ``cost_model``:
    * "trimmed" (default): the verify of a round runs every row at the width ``w`` = the longest
      admitted prefix of the batch (rounded up to ``width_buckets``), so admitting a draft costs
      ``rows`` tokens when it lengthens the window and nothing otherwise; Algorithm 1 with that
      cost. The round reads the admitted lengths back once to pick the width (``verify_width``).
    * "padded": the verify runs every row at the full width N whatever is admitted, so ``SPS(B)``
      is one constant and Algorithm 1 admits every draft (scheduled = fixed).
    * "packed": the paper's ``sum (1 + l_r)``: each row verifies its own admitted prefix in a
      packed variable-length verify (``packed_verify.py``) of ``verify_slots(sum (1 + l_r))``
      token slots, read back once like the trimmed window. Targets whose rows are not
      independent cannot pack (``LLM`` refuses the model there).
    * "auto" (``LLM(cost_model="auto")``; ``LLM``'s default where the target packs until session 41,
      when the trimmed model's window rounds beat its packed rounds at 64 rows): "packed" for rounds
      of at least ``PACKED_MIN_ROWS`` rows, "trimmed" below (``model_for``). ``cost_model`` reads as the model
      of the current round (``use_rows`` sets it; "trimmed" until a round does), ``configured``
      as what was set."""

    def __init__(self, num_spec_tokens: int, max_tokens: int, device,
                 calibration: Calibration | None = None, cost: CostCurve | None = None,
                 cost_model: str = "trimmed", admission_overhead_ms: float = ADMISSION_OVERHEAD_MS,
                 round_overhead_ms: float = ROUND_OVERHEAD_MS, learn_costs: bool = False):
        """``learn_costs``: scale the AR fallback's prices by what the rounds cost as they run
        (``round_costs``; the Scheduler observes them); off: the cost curve's prices alone, the
        same decision on every process of a group."""
        self.num_spec_tokens = num_spec_tokens
        self.calibration = calibration or Calibration()
        self.cost = cost or CostCurve.default()
        self.cost_model = cost_model
        self.admission_overhead_ms = admission_overhead_ms
        self.round_overhead_ms = round_overhead_ms
        self.widths = width_buckets(num_spec_tokens) if num_spec_tokens else []
        self.round_costs = RoundCosts() if learn_costs else None
        self.max_rows = max(1, max_tokens // (num_spec_tokens + 1))   # the row counts ``row_choices`` covers
        self._host_tables: tuple | None = None              # (sps, round_ms) on the host: packed_gain
        self.slot_buckets = token_buckets(max(1, max_tokens))
        self.inv_temp = self.calibration.inv_temperatures(num_spec_tokens, device)
        self._inv_temp_host = self.inv_temp.cpu().numpy().astype(np.float64)
        self.sps = self.cost.sps_table(max(1, max_tokens), device)
        self.round_ms = self.round_ms_table(max(1, max_tokens), device)
        self.window_sps = self.window_sps_table(max(1, max_tokens), device)

    @property
    def cost_model(self) -> str:
        """The cost model of the current round ("trimmed", "padded" or "packed")."""
        return self._active

    @cost_model.setter
    def cost_model(self, value: str) -> None:
        if value not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {value!r}")
        self.configured = value
        self._active = "trimmed" if value == "auto" else value
        self._clear_decisions()

    def _clear_decisions(self) -> None:
        """Drop the decisions cached per row count (they depend on the cost model)."""
        self._option_ms: dict[tuple, np.ndarray] = {}      # (rows, id(cost)) -> option_ms
        self._cannot_pay: dict[tuple, bool] = {}            # (rows, id(cost)) -> drafting_cannot_pay
        self._values: tuple | None = None                   # (survival, cost, tokens, {rows: values}): the last curve
        self._row_prices: tuple | None = None               # (cost, option ms [R + 1, widths], AR ms [R + 1])
        self._row_choices: list[tuple] = []                 # (survival, cost, choices) of the latest curves
        self._heads: tuple = (None, None, {})               # (survival, cost, {rows: head_width}): the last curve

    def model_for(self, rows: int) -> str:
        """The cost model of a round of ``rows`` rows: under "auto" "packed" from ``PACKED_MIN_ROWS``
        rows, "trimmed" below; else the configured one."""
        if self.configured == "auto":
            return "packed" if rows >= PACKED_MIN_ROWS else "trimmed"
        return self._active

    def use_rows(self, rows: int) -> str:
        """Make ``model_for(rows)`` the current ``cost_model`` (a round of ``rows`` rows is next)."""
        self._active = self.model_for(rows)
        return self._active

    def activate(self, model: str) -> None:
        """Make ``model`` (one of ``bucket_models``) the current cost model (graph capture)."""
        self._active = model

    def bucket_models(self, bucket: int) -> list[str]:
        """The cost models the rounds of a batch bucket of ``bucket`` rows may run (graphs to capture)."""
        if self.configured != "auto":
            return [self._active]
        return ["trimmed"] + (["packed"] if bucket >= PACKED_MIN_ROWS else [])

    def admits_every_draft(self, mode: np.ndarray) -> bool:
        """Whether a round of these row modes (host [B] ``MODE_IDS``; rows = live rows) runs as a
        fixed round (the fixed-N steps, without the head or the admission): no threshold row, and
        either the padded cost model (Algorithm 1 admits every draft) or the trimmed one where the
        cost curve cannot repay the admission: ``latency(rows x (N+1)) - latency(rows x 2)``, the
        most a trimmed window saves, is below ``admission_overhead_ms``, or the curve is the
        built-in guess (``CostCurve.default``: no measured ``verify_cost.json``)."""
        if bool((mode == MODE_IDS["threshold"]).any()):
            return False
        model = self.model_for(len(mode))
        if model == "padded":
            return True
        if model == "trimmed":
            if self.cost.source == "default":
                return True
            rows, n = max(1, len(mode)), self.num_spec_tokens
            saving = self.cost.window_ms(rows, n) - self.cost.window_ms(rows, 1)
            return saving < self.admission_ms(rows)
        return False

    @property
    def falls_back(self) -> bool:
        """Whether all-scheduled batches may run AR rounds instead (the cost curve has the draft and
        AR step latencies; ``prefers_ar``)."""
        return self.cost.has_steps and self.num_spec_tokens > 0

    def admission_ms(self, rows: float) -> float:
        """What a confidence round costs over a fixed one at ``rows`` rows: ``admission_overhead_ms``
        (host: read-back, decisions) plus the cost curve's measured device share ``admission_ms``
        where it has one."""
        if self.cost.admission_ms is None:
            return self.admission_overhead_ms
        return self.admission_overhead_ms + self.cost.step_ms("admission", max(rows, 1))

    def overhead_ms(self, rows: float, ar: bool = False) -> float:
        """Host time of a round at ``rows`` rows outside its device steps: the cost curve's
        measured ``host_ms`` (with ``ar``, the AR round's ``ar_host_ms`` where the curve has it)
        plus ``SCHEDULER_ROW_MS`` per row where it has one, else ``round_overhead_ms``."""
        if self.cost.host_ms is None:
            return self.round_overhead_ms
        kind = "ar_host" if ar and self.cost.ar_host_ms is not None else "host"
        return self.cost.step_ms(kind, max(rows, 1)) + SCHEDULER_ROW_MS * rows

    def estimates_windows(self, rows: int) -> bool:
        """Whether an all-scheduled batch of ``rows`` rows takes its trimmed window from the
        survival estimate and runs it as a window round (``Scheduler._estimated_window``): the
        trimmed model from ``ESTIMATED_WINDOW_MIN_ROWS`` rows, where the round's own admitted
        lengths would be close to the estimate's and their read-back stalls the device."""
        return self.model_for(rows) == "trimmed" and rows >= ESTIMATED_WINDOW_MIN_ROWS

    def option_ms(self, rows: int) -> np.ndarray:
        """[len(widths)] the round's ms at ``rows`` rows for each window (``spec_options``' cost),
        cached per row count: the rounds' decisions read it every round."""
        ms = self._option_ms.get((rows, id(self.cost)))
        if ms is None:
            n, draft = self.num_spec_tokens, self.cost.step_ms("draft", rows)
            admission = self.admission_ms(rows)
            if self.estimates_windows(rows):
                # window rounds: a draft of w rows; one in CONFIDENCE_PROBE_EVERY is a probe, which
                # drafts the whole block and admits (its cost over the window round)
                dw = [self.cost.draft_window(rows, w) for w in self.widths]
                ms = [d + (draft - d + admission) / CONFIDENCE_PROBE_EVERY if w < n else draft
                      for w, d in zip(self.widths, dw)]
            else:
                ms = [draft + (admission if w < n else 0.0) for w in self.widths]
            ms = np.array(ms) + np.array([self.overhead_ms(rows) + self.cost.window_ms(rows, w)
                                          for w in self.widths])
            self._option_ms[(rows, id(self.cost))] = ms
        return ms

    def _committed(self, survival) -> np.ndarray:
        """[N] expected committed tokens per row of a round verifying k + 1 drafts: ``1 + sum_{j<=k}
        s_j`` (a shorter curve: 0 past its end)."""
        s = np.zeros(self.num_spec_tokens)
        v = np.asarray(survival, dtype=np.float64)[: self.num_spec_tokens]
        s[: len(v)] = v
        return 1.0 + np.cumsum(s)

    def _option_tokens(self, survival) -> np.ndarray:
        """[len(widths)] expected committed tokens per row of each window: ``1 + sum_{k<w} s_k``."""
        return self._committed(survival)[np.asarray(self.widths) - 1]

    def _option_values(self, rows: int, survival) -> np.ndarray:
        """[len(widths)] expected committed tokens per row per ms of each window (with
        ``round_costs``: each priced as its kind of round has been running, ``option_kind``). A
        round's decisions (``prefers_ar``, ``best_window``, ``probe_loss``) read the same survival
        array (``SurvivalEstimate.curve``, a new array per estimate): without ``round_costs`` its
        values are computed once per row count for them (its expected tokens once per curve)."""
        last = self._values
        if last is None or last[0] is not survival or last[1] is not self.cost:
            last = (survival, self.cost, self._option_tokens(survival), {})
            if isinstance(survival, np.ndarray):            # a list may change in place: not kept
                self._values = last
        if self.round_costs is None and rows in last[3]:
            return last[3][rows]
        ms = self.option_ms(rows)
        if self.round_costs is not None:
            ms = ms * np.array([self._scale(self.option_kind(rows, w), rows, "fixed") for w in self.widths])
            return last[2] / ms
        last[3][rows] = values = last[2] / ms
        return values

    def spec_options(self, rows: int, survival) -> list[tuple[int, float]]:
        """Expected committed tokens per row per ms of a speculative round at ``rows`` rows for each
        window it may verify, from a prefix-survival estimate ``survival[k] = P(drafts 0..k
        accepted)`` ([N], e.g. ``SurvivalEstimate.curve``): ``(w, (1 + sum_{k<w} s_k) /
        (draft_ms + latency(rows x (1 + w)) + overhead_ms(rows) [+ admission_ms(rows) for w <
        N]))`` for w in ``widths``; w = N is the fixed round (no head, no admission). From
        ``ESTIMATED_WINDOW_MIN_ROWS`` rows the trimmed model's windows run as window rounds and
        only one in ``CONFIDENCE_PROBE_EVERY`` pays the admission (``option_ms``)."""
        return list(zip(self.widths, self._option_values(rows, survival).tolist()))

    def best_window(self, rows: int, survival) -> int:
        """The window of the best option of ``spec_options(rows, survival)`` (ties: the wider); N
        unless that window beats the fixed round by ``TRIM_MARGIN`` (the curve's error on narrow
        rounds is of that order, and the fixed round needs no head, admission or read-back)."""
        choices = self.row_choices(survival, rows)
        if choices is not None:
            return int(choices.window[rows])
        return int(self._best_windows(self._option_values(rows, survival)[None])[0])

    def _best_windows(self, values: np.ndarray) -> np.ndarray:
        """[rows] ``best_window`` of each row of option values [rows, widths]."""
        widths = np.asarray(self.widths)
        best = values.shape[1] - 1 - np.argmax(values[:, ::-1], axis=1)                # ties: the wider
        chosen = values[np.arange(len(values)), best]
        if self.widths[-1] == self.num_spec_tokens:
            return np.where(chosen < (1.0 + TRIM_MARGIN) * values[:, -1], self.num_spec_tokens, widths[best])
        return widths[best]

    def row_choices(self, survival, rows: int = 1) -> "RowChoices | None":
        """The decisions of one survival curve at every row count 1 .. R = ``max_rows`` (entry 0 as
        row 1's), from one array of option values [R + 1, widths]: AR's and the best window's tokens
        per ms (``prefers_ar`` at any margin) and the best window (``best_window``), so a round
        reads its decisions whatever its row count (a steady load's batch changes between the round
        whose host work prepared them and the next) at no host cost on its path. Cached for the two
        latest curves (the AR fallback's ``SurvivalEstimate.optimistic`` and ``curve``). None with
        learned round costs (their prices move every round), past ``max_rows`` or for a curve that
        is not an array."""
        if self.round_costs is not None or rows > self.max_rows or not isinstance(survival, np.ndarray):
            return None
        for s, cost, choices in self._row_choices:
            if s is survival and cost is self.cost:
                return choices
        if self._row_prices is None or self._row_prices[0] is not self.cost:
            r = range(1, self.max_rows + 1)
            ms, ar_ms = np.stack([self.option_ms(i) for i in r]), np.array([self.priced_ms("ar", i) for i in r])
            self._row_prices = (self.cost, np.concatenate([ms[:1], ms]), np.concatenate([ar_ms[:1], ar_ms]))
        _, ms, ar_ms = self._row_prices
        values = self._option_tokens(survival)[None] / ms                            # [R + 1, widths]
        choices = RowChoices(ar_rate=1.0 / ar_ms, best_rate=values.max(axis=1), window=self._best_windows(values))
        self._row_choices = self._row_choices[-1:] + [(survival, self.cost, choices)]
        return choices

    def prefers_full_window(self, rows: int, survival) -> bool:
        """Whether the best option of ``spec_options(rows, survival)`` is the fixed round (w = N):
        then a scheduled batch runs the plain draft and verify, without the head, the admission
        and the read-back of the admitted lengths, which it would pay to verify the same window."""
        return self.best_window(rows, survival) == self.num_spec_tokens

    def prefers_ar(self, rows: int, survival, margin: float = AR_MARGIN) -> bool:
        """Whether an AR round (1 token per row in ``ar_ms(rows) + overhead_ms(rows, ar=True)``) is expected
        to beat the best speculative option of ``spec_options(rows, survival)`` by more than
        ``margin`` (relative): the decision compares expected tokens per ms of the options, not a
        measured tau of past trimmed rounds. With ``round_costs`` each side's price is scaled by
        what such rounds cost as they ran (as in ``best_window``); without, the decision is a
        function of the curve and the batch's history only (the same on every TP rank)."""
        if not self.falls_back:
            return False
        choices = self.row_choices(survival, rows)
        if choices is not None:
            return bool(choices.ar_rate[rows] > (1.0 + margin) * choices.best_rate[rows])
        ar_ms = self.priced_ms("ar", rows) * self._scale("ar", rows)
        return 1.0 / ar_ms > (1.0 + margin) * float(self._option_values(rows, survival).max())

    def drafting_cannot_pay(self, rows: int) -> bool:
        """Whether an AR round beats every speculative option at ``rows`` rows even if every draft
        were accepted (``prefers_ar`` of the all-ones survival curve, no margin), on the cost
        curve's prices alone: then no outcome of a speculative round can change the AR decision
        there, and an AR streak's probes are pointless. False with learned round costs (a probe
        also updates their prices) or without the fallback. Cached per row count."""
        if not self.falls_back or self.round_costs is not None:
            return False
        key = (rows, id(self.cost))
        if key not in self._cannot_pay:
            best = self._option_tokens(np.ones(self.num_spec_tokens)) / self.option_ms(rows)    # [widths]
            self._cannot_pay[key] = 1.0 / self.priced_ms("ar", rows) > float(best.max())
        return self._cannot_pay[key]

    def probe_loss(self, rows: int, survival, pending: int = 0, confidence_round: bool = False) -> float:
        """What one speculative round of the best option costs an AR streak, in AR rounds: its
        price ``p*`` (``confidence_round``: a window option run as the confidence round over that
        window, as a probe runs before any confidence round gave the estimate the head's prior)
        plus the draft's context write of the streak's ``pending`` deferred rows
        (``CostCurve.context``, 0 without it) buys ``(p* + context) / ar price`` AR tokens per row
        where it commits ``t*`` (the best option's expected tokens), so ``(p* + context) / ar
        price - t*``, at least 0. The Scheduler spaces an AR streak's probes so that they lose at
        most ``PROBE_BUDGET`` of its rounds."""
        v = self._option_values(rows, survival)
        best = int(np.argmax(v))
        t, w = float(self._option_tokens(survival)[best]), self.widths[best]
        price = t / float(v[best])
        if confidence_round and self.option_kind(rows, w) == "window":
            price = self.priced_ms("confidence", rows, w) * self._scale("confidence", rows, "fixed")
        ar = self.priced_ms("ar", rows) * self._scale("ar", rows)
        return max(0.0, (price + self.cost.context(pending)) / ar - t)

    def _scale(self, kind: str, rows: int, prior: str | None = None) -> float:
        """``round_costs``' factor on the price of a ``kind`` round (1 without learned costs)."""
        return 1.0 if self.round_costs is None else self.round_costs.scale(kind, rows, prior)

    def option_kind(self, rows: int, width: int) -> str:
        """The round an option of ``width`` drafts runs as: "fixed" (all N), "window" (from
        ``ESTIMATED_WINDOW_MIN_ROWS`` rows: no head, no admission) or "confidence" (the head, the
        admission and the read-back of its lengths)."""
        if width == self.num_spec_tokens:
            return "fixed"
        return "window" if self.estimates_windows(rows) else "confidence"

    def priced_ms(self, kind: str, rows: int, width: int | None = None) -> float:
        """The cost curve's price of a round of ``kind`` (``option_kind``, or "ar": the fallback's AR
        round) verifying ``width`` drafts (None: N): ``option_ms``; a confidence round drafts the
        whole block with the head and admits before its verify of ``width`` (at many rows
        ``option_ms`` prices a window as the window round it usually runs as)."""
        if kind == "ar":
            return self.cost.step_ms("ar", rows) + self.overhead_ms(rows, ar=True)
        w = self.num_spec_tokens if width is None else width
        if kind == "confidence":          # the whole block drafted with the head, admitted, w verified
            return (self.cost.step_ms("draft", rows) + self.admission_ms(rows) + self.overhead_ms(rows)
                    + self.cost.window_ms(rows, w))
        return float(self.option_ms(rows)[self.widths.index(w)])

    def window_sps_table(self, max_rows: int, device) -> Tensor | None:
        """[max_rows + 1, N] float32: ``1 / window_ms(r, w)`` (the trimmed admission's SPS by rows
        and width), None without the cost curve's ``verify_ms``."""
        if self.cost.verify_ms is None or not self.num_spec_tokens:
            return None
        widths = range(1, self.num_spec_tokens + 1)
        return torch.tensor([[1.0 / self.cost.window_ms(max(r, 1), w) for w in widths]
                             for r in range(max_rows + 1)], dtype=torch.float32, device=device)

    def round_ms_table(self, max_rows: int, device) -> Tensor | None:
        """[max_rows + 1] float32: a trimmed confidence round's cost outside the verify at r rows
        (draft step + ``admission_overhead_ms`` + ``overhead_ms``), what Algorithm 1 adds to
        ``1 / SPS(B)``; None without the draft step's latency."""
        if not self.cost.has_steps:
            return None
        return torch.tensor([self.cost.step_ms("draft", max(r, 1)) + self.admission_ms(r)
                             + self.overhead_ms(max(r, 1))
                             for r in range(max_rows + 1)], dtype=torch.float32, device=device)

    @property
    def trims(self) -> bool:
        """Whether confidence rounds verify a window trimmed to the admitted lengths."""
        return self.cost_model != "padded"

    @property
    def packs(self) -> bool:
        """Whether confidence rounds verify each row's own prefix, packed (``packed_verify.py``)."""
        return self.cost_model == "packed"

    def verify_slots(self, tokens: int) -> int:
        """The packed verify's slot count for ``tokens`` window tokens: the least slot bucket >= it."""
        return next((b for b in self.slot_buckets if b >= tokens), self.slot_buckets[-1])

    def verify_shape(self, lengths, rows: int, head: int | None = None) -> tuple[int, int | None]:
        """(width, slots) of the verify of a confidence round whose live rows admitted ``lengths``
        (host [live]) in a batch of ``rows`` rows (inert ones included) of ``head`` (None: N)
        drafts: trimmed, ``(verify_width(max l), None)``; packed, ``(head, verify_slots(sum (1 +
        l)))``, unless the rectangular window ``verify_width(max l)`` runs no more tokens (``rows x
        (1 + w)``), then that window (each row still verifies its own prefix: the packed model keeps
        the limits)."""
        lengths = np.asarray(lengths)
        w = self.verify_width(int(lengths.max()) if lengths.size else 0)
        if not self.packs:
            return w, None
        slots = self.verify_slots(int((1 + lengths).sum()))
        return (w, None) if rows * (1 + w) <= slots else (head or self.num_spec_tokens, slots)

    def slot_sizes(self, rows: int, head: int | None = None) -> list[int]:
        """The slot buckets a packed verify of up to ``rows`` rows of ``head`` (None: N) drafts may
        run (to capture)."""
        top = self.verify_slots(rows * (1 + (head or self.num_spec_tokens)))
        return [b for b in self.slot_buckets if b <= top]

    @property
    def head_widths(self) -> list[int]:
        """The drafted widths a packed confidence round may run (``head_width``): the width buckets
        from N / 2 to N (each its own "draft_admit" graph and slot graphs)."""
        return [w for w in self.widths if 2 * w >= self.num_spec_tokens]

    def bucket_heads(self, rows: int) -> list[int]:
        """The head widths to capture graphs of for a batch bucket of ``rows`` rows: ``head_widths``
        where drafting the narrowest saves more than ``HEAD_MARGIN`` of the round's least cost
        (the draft's share grows with the rows, so the bucket's smaller row counts save less), else
        N alone (``head_width`` narrows nowhere there)."""
        n, narrowest = self.num_spec_tokens, self.head_widths[0]
        if not self.cost.has_steps or narrowest >= n:
            return [n]
        narrow = self.cost.draft_window(rows, narrowest)
        least = narrow + self.admission_ms(rows) + self.overhead_ms(rows) + self.cost.latency(rows)
        return self.head_widths if self.cost.step_ms("draft", rows) - narrow > HEAD_MARGIN * least else [n]

    def head_width(self, rows: int, survival) -> int:
        """The drafted width h of a packed confidence round at ``rows`` rows: the LM head, the Markov
        sampler and the confidence head run on the first h drafts only (the block pass stays the
        N-token one), so no row admits past h. The ``head_widths`` entry of the most expected tokens
        per ms, ``rows (1 + S_h) / (draft_window(rows, h) + admission + overhead + latency(rows (1 +
        S_h)))`` with ``S_h = sum_{k<h} s_k`` of the prefix-survival estimate ``survival``, where
        it beats all N by ``HEAD_MARGIN``; N without the cost curve's draft latencies. (H100,
        Qwen3-8B dimensions at 64 rows: the draft step 3.19 ms at 7 drafts, 2.57 ms at 4; the
        replayed survival past the 4th draft 0.015 tokens a row.) Cached per row count for the
        latest curve (an array): the Scheduler's host work asks first, the round then reads it."""
        if not isinstance(survival, np.ndarray):            # a list may change in place: not kept
            return self._head_width(rows, survival)
        if self._heads[0] is not survival or self._heads[1] is not self.cost:
            self._heads = (survival, self.cost, {})
        heads = self._heads[2]
        if rows not in heads:
            heads[rows] = self._head_width(rows, survival)
        return heads[rows]

    def _head_width(self, rows: int, survival) -> int:
        n = self.num_spec_tokens
        if rows <= 0 or len(self.bucket_heads(rows)) == 1:       # no graphs of narrowed heads where they cannot pay
            return n
        committed = self._committed(survival)                    # [N]: 1 + S_h at index h - 1
        fixed_ms = self.admission_ms(rows) + self.overhead_ms(rows)

        def value(h: int) -> float:
            tokens = rows * float(committed[h - 1])
            return tokens / (self.cost.draft_window(rows, h) + fixed_ms + self.cost.latency(tokens))
        best = max(self.head_widths, key=lambda h: (value(h), h))
        return best if value(best) > (1.0 + HEAD_MARGIN) * value(n) else n

    def verify_width(self, max_admitted: int) -> int:
        """The verify window (drafts) of a trimmed round whose longest admitted prefix is
        ``max_admitted``: the least width bucket >= it (1 at least: row 0 of the verify is the
        anchor's, a width-0 window would still need the target's next token)."""
        return next(w for w in self.widths if w >= max(1, max_admitted))

    def calibrated(self, conf_logits) -> np.ndarray:
        """Host [rows, N] confidence logits -> the calibrated conditional confidences
        ``sigmoid(logit_k / T_k)`` (float64), as ``admitted_lengths`` computes them on the device."""
        z = np.asarray(conf_logits, dtype=np.float64)
        return 1.0 / (1.0 + np.exp(-z * self._inv_temp_host[None, :z.shape[1]]))

    def packed_gain(self, confidence) -> float:
        """Expected tokens per ms of a packed round over the fixed round's for rows whose
        calibrated conditional confidences are ``confidence`` [rows, N] (host; e.g. the last
        confidence round's): Algorithm 1's packed admission of those rows (``admitted_lengths``
        on host copies of the tables) priced by the token curve plus ``round_ms`` (the round's cost
        outside the verify, as the admission prices it), against all N drafts priced as the fixed
        round. Needs the cost curve's step latencies (``falls_back``). Per row, not per batch: rows whose
        confidences differ can gain where no common window does (``spec_options``)."""
        c = torch.as_tensor(np.asarray(confidence, dtype=np.float64)).clamp(1e-6, 1 - 1e-6)
        rows, n = c.shape
        if not rows or not n:
            return 0.0
        if self._host_tables is None:       # packed batches fall back to AR too: the curve has steps
            self._host_tables = (self.sps.cpu(), self.round_ms.cpu())
        sps, round_ms = self._host_tables
        mode = torch.full((rows,), MODE_IDS["scheduled"])
        length = admitted_lengths(torch.logit(c).float(), torch.ones(rows, dtype=torch.bool), mode,
                                  torch.zeros(rows), torch.ones(n), sps, round_ms=round_ms)
        a = torch.cumprod(c, 1)
        k = torch.arange(n)[None]
        tokens = rows + int(length.sum())
        packed_ms = self.cost.latency(tokens) + float(round_ms[min(rows, len(round_ms) - 1)])
        packed = (rows + float((a * (k < length[:, None])).sum())) / packed_ms
        fixed = (rows + float(a.sum())) / float(self.option_ms(rows)[-1])
        return packed / fixed

    def admit(self, conf_logits: Tensor, live: Tensor, mode: Tensor, threshold: Tensor) -> Tensor:
        padded = self.num_spec_tokens if self.cost_model == "padded" else None
        return admitted_lengths(conf_logits, live, mode, threshold, self.inv_temp, self.sps, padded,
                                trimmed=self.cost_model == "trimmed", round_ms=self.round_ms,
                                window_sps=self.window_sps)
