"""Confidence-scheduled verification (paper §3.2, algorithm doc §3.5): how many drafts a row verifies.

Per request (``SamplingParams.verify_mode``):

* ``fixed``      verify all N drafts (the default; no confidence head needed).
* ``threshold``  DeepSpec's per-step rule: verify the drafts before the first position whose raw
                 confidence ``sigmoid(logit_k)`` is below ``confidence_threshold`` (0 drafts when it
                 is position 0).
* ``scheduled``  the paper's Algorithm 1 over all scheduled rows of the batch: prefix-survival
                 probabilities ``a_{r,k} = prod_{j<=k} c_{r,j}`` (calibrated ``c = sigmoid(logit / T_k)``)
                 are admitted greedily in descending order (stable: ties keep row-major order, so a
                 row's positions stay a prefix) while the expected throughput
                 ``Theta = tau * SPS(B)`` strictly grows; the first non-improving candidate stops the
                 search (the early stop that keeps the admission of draft k independent of x_k).
                 ``B`` = total verified tokens of the batch (1 + admitted per row, fixed / threshold
                 rows counted with their lengths), ``tau`` = expected committed tokens,
                 ``SPS(B) = 1 / latency(B)`` from a ``CostCurve`` (trimmed model with step
                 latencies: ``1 / (latency(B) + draft_ms + admission overhead)``, the whole round).

The admitted lengths are computed on the device from the confidence logits of the draft step (no
host synchronisation; inside the draft CUDA graph on the graph path). The verify always runs all N
drafts (the fixed-N shape); verification of an admitted prefix of ``l`` drafts stays exact: the
verifier's acceptance is clamped to ``l`` and, when all ``l`` pass, the next token is sampled from the
target row ``l`` (a bonus token), see ``steps.DecodeSteps.verify_step``. Since that verify costs the
same whatever is admitted, the scheduler's default cost model is "padded" (``VerifyScheduler``).

Files (JSON, next to a draft checkpoint or in an engine directory):
``confidence_calibration.json``  {"temperatures": [T_0 .. T_{N-1}], "survival": [held-out
                                 P(drafts 0..k accepted)], "ece_before", "ece_after", ...}
``verify_cost.json``             {"tokens": [n_1 < n_2 < ...], "latency_ms": [...], "source": ...}
                                 (verify-step latency vs total verified tokens; ``dspark-trt bench
                                 --cost-curve`` measures it; linear interpolation between points,
                                 linear extrapolation beyond the last two)
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..checkpoints.files import CALIBRATION_FILE
from ..config.source import VERIFY_COST_MODELS
from .packed_verify import token_buckets
from .round_costs import RoundCosts

VERIFY_MODES = ("fixed", "threshold", "scheduled")
MODE_IDS = {m: i for i, m in enumerate(VERIFY_MODES)}
COST_FILE = "verify_cost.json"


class ConfidenceFileError(ValueError):
    """A calibration or cost-curve file is malformed (the message names the file and field)."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfidenceFileError(f"{path}: unreadable JSON ({e})") from None


# ---- calibration ----------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Per-position temperatures of Sequential Temperature Scaling: ``c_k = sigmoid(logit_k / T_k)``.
    Positions beyond the list use its last entry; no calibration = all 1."""

    temperatures: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def survival(self, n: int) -> np.ndarray | None:
        """[<= n] the held-out prefix survival ``P(drafts 0..k accepted)`` that ``dspark-trt
        calibrate`` measured (``"survival"``), None when the file has none (older calibrations)."""
        s = self.metrics.get("survival")
        return None if not s else np.asarray(s[:n], dtype=np.float64)

    def inv_temperatures(self, n: int, device) -> Tensor:
        t = [self.temperatures[min(k, len(self.temperatures) - 1)] if self.temperatures else 1.0
             for k in range(n)]
        return 1.0 / torch.tensor(t, dtype=torch.float32, device=device)

    def to_json(self) -> dict:
        return {"temperatures": list(map(float, self.temperatures)), **self.metrics}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CALIBRATION_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        d = _read_json(Path(path))
        t = d.get("temperatures")
        if not isinstance(t, list) or not t or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in t):
            raise ConfidenceFileError(f"{path}: 'temperatures' must be a non-empty list of positive "
                                      f"numbers, got {t!r}")
        s = d.get("survival")
        if s is not None and not (isinstance(s, list) and all(
                isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in s)):
            raise ConfidenceFileError(f"{path}: 'survival' must be a list of probabilities in [0, 1], "
                                      f"got {s!r}")
        return cls([float(v) for v in t], {k: v for k, v in d.items() if k != "temperatures"})

    @classmethod
    def find(cls, *directories) -> "Calibration | None":
        for d in directories:
            if d is not None and (Path(d) / CALIBRATION_FILE).exists():
                return cls.load(Path(d) / CALIBRATION_FILE)
        return None


# ---- cost curve -----------------------------------------------------------------------------------

def _interp(xs: list, ys: list, n: float) -> float:
    """Piecewise-linear through (xs, ys), flat below xs[0], linear past the last two points
    (proportional for one point)."""
    if len(xs) == 1:
        return ys[0] * max(n, 1) / xs[0]
    i = next((i for i in range(1, len(xs)) if xs[i] >= n), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if n <= x0:
        return y0
    return max(1e-9, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


@dataclass
class CostCurve:
    """Verify-step latency (ms) vs total verified tokens of the batch; optionally the draft step's
    and the autoregressive step's latency vs batch rows (``rows``, ``draft_ms``, ``ar_ms``: what
    the scheduler's AR fallback compares, ``VerifyScheduler.prefers_ar``), and the verify's
    latency by rows and window (``verify_ms [rows][w - 1]``, w = 1 .. N: what a trimmed window
    costs; the token curve alone misses what grows with the rows at equal tokens, e.g. 64 x 3
    against 24 x 8), and ``admission_ms`` per rows: what a confidence round's steps (head,
    admission, the verify with limits) cost on the device over the fixed round's at the same width
    (on the H200 at Qwen3-8B dims a confidence round cost ~0.3 ms more than a fixed one at 16
    rows and ~1.6 ms at 64, round kinds of 0ab0aab: the constant ``ADMISSION_OVERHEAD_MS``
    under-priced every trimmed window at 64 rows), and ``draft_window_ms [rows][w - 1]``, w = 1 ..
    N - 1: the window round's draft step (its head and Markov sampler over w rows; on the H200 at
    64 rows the sampler alone takes 182 us for 2 drafts against 642 for 7, profile-window-b64-dda0476),
    and ``host_ms`` per rows: a fixed round called from the host (inputs staged, results read back)
    minus its draft and verify steps (``VerifyScheduler.overhead_ms``), and ``context_ms`` vs
    ``context_tokens``: the draft's context write of that many rows as a flush makes it
    (``ContextRows.write``: a CUDA graph per row bucket under ``GraphedSteps``), what the first speculative round after an AR streak pays for the streak's deferred
    rows (``VerifyScheduler.probe_loss``), and ``ar_host_ms`` per rows: the fallback's AR round
    called from the host minus its AR step (it stages and reads back less than a speculative
    round: H100, default pair, batch 1, steady load: 0.06 ms against 0.12; priced with the
    speculative round's ``host_ms`` AR lost a 1.21x lead to a 5 % margin, session 40)."""

    tokens: list[int]
    latency_ms: list[float]
    source: str = "default"
    rows: list[int] | None = None
    draft_ms: list[float] | None = None
    ar_ms: list[float] | None = None
    verify_ms: list[list[float]] | None = None
    admission_ms: list[float] | None = None
    draft_window_ms: list[list[float]] | None = None
    host_ms: list[float] | None = None
    context_tokens: list[int] | None = None
    context_ms: list[float] | None = None
    ar_host_ms: list[float] | None = None

    def __post_init__(self):
        ok = (len(self.tokens) == len(self.latency_ms) >= 1
              and all(isinstance(n, int) and n >= 1 for n in self.tokens)
              and all(b > a for a, b in zip(self.tokens, self.tokens[1:]))
              and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.latency_ms))
        if not ok:
            raise ConfidenceFileError(f"cost curve ({self.source}): 'tokens' must be increasing integers "
                                      f">= 1 and 'latency_ms' positive numbers of the same length")
        steps = (self.rows, self.draft_ms, self.ar_ms)
        if any(v is not None for v in steps) and not (
                all(v is not None and len(v) == len(self.rows) >= 1 for v in steps)
                and all(isinstance(n, int) and n >= 1 for n in self.rows)
                and all(b > a for a, b in zip(self.rows, self.rows[1:]))
                and all(math.isfinite(v) and v > 0 for v in self.draft_ms + self.ar_ms)):
            raise ConfidenceFileError(f"cost curve ({self.source}): 'rows' (increasing integers >= 1), "
                                      f"'draft_ms' and 'ar_ms' (positive) must come together, same length")
        for name, widths in (("verify_ms", "1 .. N"), ("draft_window_ms", "1 .. N - 1")):
            g = getattr(self, name)
            if g is not None and not (
                    self.rows is not None and len(g) == len(self.rows) and len(g[0]) >= 1
                    and all(len(r) == len(g[0]) for r in g)
                    and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for r in g for v in r)):
                raise ConfidenceFileError(f"cost curve ({self.source}): '{name}' must be one list of positive "
                                          f"latencies per entry of 'rows', each of the same length (widths {widths})")
        for name in ("admission_ms", "host_ms", "ar_host_ms"):
            a = getattr(self, name)
            if a is not None and not (self.rows is not None and len(a) == len(self.rows) and all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in a)):
                raise ConfidenceFileError(f"cost curve ({self.source}): '{name}' must be one non-negative "
                                          f"latency per entry of 'rows'")
        if self.ar_host_ms is not None and self.host_ms is None:
            raise ConfidenceFileError(f"cost curve ({self.source}): 'ar_host_ms' needs 'host_ms' (the AR "
                                      f"round's host time is priced beside the speculative round's)")
        ct, cm = self.context_tokens, self.context_ms
        if (ct is None) != (cm is None) or ct is not None and not (
                len(ct) == len(cm) >= 1 and all(isinstance(n, int) and n >= 1 for n in ct)
                and all(b > a for a, b in zip(ct, ct[1:]))
                and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in cm)):
            raise ConfidenceFileError(f"cost curve ({self.source}): 'context_tokens' (increasing integers "
                                      f">= 1) and 'context_ms' (non-negative) must come together, same length")

    @property
    def has_steps(self) -> bool:
        """Whether the draft and AR step latencies are known (the AR fallback needs them)."""
        return self.rows is not None

    def step_ms(self, kind: str, rows: float) -> float:
        """The "draft", "ar", "admission", "host" or "ar_host" step's latency at ``rows`` rows
        (interpolated like ``latency``)."""
        return _interp(self.rows, {"draft": self.draft_ms, "ar": self.ar_ms, "admission": self.admission_ms,
                                   "host": self.host_ms, "ar_host": self.ar_host_ms}[kind], rows)

    def context(self, tokens: float) -> float:
        """The draft's context write of ``tokens`` rows (0 for none, or without ``context_ms``)."""
        if tokens <= 0 or self.context_ms is None:
            return 0.0
        return _interp(self.context_tokens, self.context_ms, tokens)

    @classmethod
    def from_points(cls, pts: dict, source: str) -> "CostCurve":
        """The curve of ``commands.bench.cost_curve``'s measurements."""
        return cls(pts["tokens"], pts["latency_ms"], source, pts["rows"], pts["draft_ms"], pts["ar_ms"],
                   pts["verify_ms"], pts["admission_ms"], pts.get("draft_window_ms"), pts.get("host_ms"),
                   pts.get("context_tokens"), pts.get("context_ms"), pts.get("ar_host_ms"))

    @classmethod
    def default(cls) -> "CostCurve":
        """A memory-bound step: flat up to 128 verified tokens, then linear (a GPU-like shape;
        measure the real one with ``dspark-trt bench --cost-curve``)."""
        return cls([1, 128, 256, 512, 1024], [1.0, 1.0, 2.0, 4.0, 8.0], "default")

    def latency(self, n: float) -> float:
        return _interp(self.tokens, self.latency_ms, n)

    def draft_window(self, rows: float, w: int) -> float:
        """The draft step of a window round of ``w`` drafts at ``rows`` rows: ``draft_window_ms``
        interpolated over the rows where measured, else (and for w past it) the full draft step."""
        g = self.draft_window_ms
        if g is None or w > len(g[0]):
            return self.step_ms("draft", rows)
        return _interp(self.rows, [r[w - 1] for r in g], rows)

    def window_ms(self, rows: float, w: int) -> float:
        """The verify of ``rows`` rows x ``w`` drafts: ``verify_ms`` interpolated over the rows
        where measured (widths past the grid's: its widest), else ``latency(rows x (1 + w))``."""
        if self.verify_ms is None:
            return self.latency(rows * (1 + w))
        k = min(w, len(self.verify_ms[0])) - 1
        return _interp(self.rows, [r[k] for r in self.verify_ms], rows)

    def sps_table(self, max_tokens: int, device) -> Tensor:
        """[max_tokens + 1] float32: SPS(B) = 1 / latency(B) for B = 0 .. max_tokens."""
        return torch.tensor([1.0 / self.latency(max(b, 1)) for b in range(max_tokens + 1)],
                            dtype=torch.float32, device=device)

    def to_json(self) -> dict:
        steps = ({"rows": self.rows, "draft_ms": self.draft_ms, "ar_ms": self.ar_ms}
                 if self.has_steps else {})
        if self.verify_ms is not None:
            steps["verify_ms"] = self.verify_ms
        if self.admission_ms is not None:
            steps["admission_ms"] = self.admission_ms
        if self.draft_window_ms is not None:
            steps["draft_window_ms"] = self.draft_window_ms
        if self.host_ms is not None:
            steps["host_ms"] = self.host_ms
        if self.ar_host_ms is not None:
            steps["ar_host_ms"] = self.ar_host_ms
        if self.context_ms is not None:
            steps.update(context_tokens=self.context_tokens, context_ms=self.context_ms)
        return {"tokens": self.tokens, "latency_ms": self.latency_ms, **steps, "source": self.source}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / COST_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        d = _read_json(Path(path))
        return cls.from_json(d, str(d.get("source", path)) if isinstance(d, dict) else str(path), where=path)

    @classmethod
    def from_json(cls, d: dict, source: str, where=None) -> "CostCurve":
        """The curve of ``to_json``'s dict (a ``verify_cost.json``, a bench result's ``cost_curve``);
        ``ConfidenceFileError`` naming ``where`` (default: ``source``) where it is not one."""
        try:
            opt = lambda k, f: None if d.get(k) is None else [f(v) for v in d[k]]  # noqa: E731
            grid = lambda k: None if d.get(k) is None else [[float(v) for v in r] for r in d[k]]  # noqa: E731
            return cls([int(n) for n in d["tokens"]], [float(v) for v in d["latency_ms"]],
                       source, opt("rows", int), opt("draft_ms", float),
                       opt("ar_ms", float), grid("verify_ms"), opt("admission_ms", float),
                       grid("draft_window_ms"), opt("host_ms", float), opt("context_tokens", int),
                       opt("context_ms", float), opt("ar_host_ms", float))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfidenceFileError(f"{where or source}: needs 'tokens' and 'latency_ms' lists ({e})") from None

    @classmethod
    def find(cls, *directories) -> "CostCurve":
        for d in directories:
            if d is not None and (Path(d) / COST_FILE).exists():
                return cls.load(Path(d) / COST_FILE)
        return cls.default()


# ---- admission --------------------------------------------------------------------------------------

def admitted_lengths(conf_logits: Tensor, live: Tensor, mode: Tensor, threshold: Tensor,
                     inv_temp: Tensor, sps: Tensor, padded_width: int | None = None,
                     trimmed: bool = False, round_ms: Tensor | None = None,
                     window_sps: Tensor | None = None) -> Tensor:
    """How many drafts each row verifies -> [B] int64 in [0, N] (0 for rows that are not live).

    conf_logits [B, N] (confidence logits of the drafted block), live [B] bool, mode [B] int64
    (``MODE_IDS``), threshold [B] float (threshold rows), inv_temp [N] (1 / T_k of the
    calibration), sps [M] (``CostCurve.sps_table``; token counts beyond M - 1 use the last entry).

    ``padded_width``: the cost model of Algorithm 1's ``B``. None = packed (the paper's: a row
    costs ``1 + l_r`` tokens, what a variable-length verify would run); an int ``w`` = padded (every
    live row costs ``1 + w`` tokens whatever it admits, what a verify padded to ``w`` drafts runs),
    so ``SPS(B)`` is one constant and every candidate that raises ``tau`` is admitted.
    ``trimmed`` (with ``padded_width`` None): every live row costs ``1 + w`` tokens for the
    window ``w = max_r l_r``, what the verify trimmed to the longest admitted prefix runs; the
    candidates are then the window's widths (``_trimmed_lengths``). ``round_ms`` [R] (trimmed
    and packed): the round's cost outside the verify at r live rows (draft step + admission and
    host overheads, ``VerifyScheduler``), added to ``1 / SPS(B)`` so that Theta is tokens per ms
    of the whole round.

    ``window_sps`` [R, N] (trimmed only, ``VerifyScheduler.window_sps_table``): ``1 / latency`` of
    the verify of r rows at window w, used instead of ``sps`` at ``r x (1 + w)`` tokens when the
    cost curve has its ``verify_ms`` grid.

    Tensor ops only (sort, cumsum, cumprod, gathers): no host synchronisation, capturable in a
    CUDA graph.
    """
    B, N = conf_logits.shape
    dev = conf_logits.device
    c_raw = torch.sigmoid(conf_logits.float())
    a = torch.cumprod(torch.sigmoid(conf_logits.float() * inv_temp[None, :N]), 1)    # [B, N]
    a = torch.where(live[:, None], a, 0.0)
    fixed = torch.full((B,), N, dtype=torch.int64, device=dev)
    thr = torch.cumprod((c_raw >= threshold[:, None]).to(torch.int64), 1).sum(1)
    length = torch.where(mode == MODE_IDS["threshold"], thr, fixed)
    sched = live & (mode == MODE_IDS["scheduled"])
    length = torch.where(live & ~sched, length, 0)
    # Algorithm 1 over the scheduled rows; the other live rows are a fixed load
    k = torch.arange(N, device=dev)
    other = live & ~sched
    tau0 = (sched.sum() + (other * (1 + (a * (k[None] < length[:, None])).sum(1))).sum()).float()
    if trimmed and padded_width is None:
        return _trimmed_lengths(a, live, sched, other, length, tau0, sps, round_ms, window_sps)
    b0 = sched.sum() + (other * (1 + length)).sum()
    cand = torch.where(sched[:, None] & (a > 0), a, -1.0).reshape(-1)
    vals, order = torch.sort(cand, descending=True, stable=True)
    valid = vals > 0
    tau = tau0 + torch.cumsum(vals.clamp(min=0), 0)
    M = sps.shape[0]
    b = (b0 + 1 + torch.arange(B * N, device=dev)).clamp(max=M - 1)
    b0 = b0.clamp(max=M - 1)
    if padded_width is not None:                 # every live row pays 1 + w whatever it admits
        b0 = (live.sum() * (1 + padded_width)).clamp(max=M - 1)
        b = b0.expand(B * N)
    # Theta = tau * SPS(B) grows  <=>  a * SPS(b) > tau_prev * (SPS(b_prev) - SPS(b)): the same test
    # written so that a constant SPS (the padded model) admits every a > 0 despite float rounding
    s_b, s0 = sps[b], sps[b0.reshape(1)]                  # (sps[b0] on a 0-dim index syncs)
    if round_ms is not None and padded_width is None:     # packed: whole-round SPS, as trimmed
        s_b, s0 = _whole_round(s_b, s0, round_ms, live.sum())
    s_prev = torch.cat([s0, s_b[:-1]])
    tau_prev = torch.cat([tau0[None], tau[:-1]])
    improve = valid & (vals.clamp(min=0) * s_b > tau_prev * (s_prev - s_b))
    K = torch.cumprod(improve.to(torch.int64), 0).sum()
    take = torch.zeros(B * N, dtype=torch.int64, device=dev).scatter_(
        0, order, (torch.arange(B * N, device=dev) < K).to(torch.int64))
    return torch.where(sched, take.view(B, N).sum(1), length)


def _whole_round(s_b: Tensor, s0: Tensor, round_ms: Tensor, n_live: Tensor) -> tuple[Tensor, Tensor]:
    """The verify's SPS values as whole-round ones: ``1 / (1 / SPS + round_ms[n_live])`` (verify +
    draft + overheads at ``n_live`` rows, a 0-dim count read as a 1-element index: no sync)."""
    extra = round_ms[n_live.clamp(max=round_ms.shape[0] - 1).reshape(1)]                  # [1]
    return 1.0 / (1.0 / s_b + extra), 1.0 / (1.0 / s0 + extra)


def _trimmed_lengths(a: Tensor, live: Tensor, sched: Tensor, other: Tensor, length: Tensor,
                     tau0: Tensor, sps: Tensor, round_ms: Tensor | None = None,
                     window_sps: Tensor | None = None) -> Tensor:
    """Algorithm 1 for a verify trimmed to one window ``w`` of the batch: the candidates are the
    widths w = 1 .. N in order, width w adding ``sum_r a_{r,w-1}`` over the scheduled rows to tau
    and costing ``B(w) = live x (1 + max(w, m0))`` (m0: the longest fixed / threshold row, the
    window's least 1); admitted while ``tau * SPS(B)`` strictly grows, first non-improving width
    stops; ``round_ms[live]`` (the draft step + overhead) is added to each width's verify latency.
    Every scheduled row verifies the admitted width (its drafts below the window cost
    nothing more). Non-anticipating: admitting width w reads ``a_{., w-1}``, i.e. confidences up
    to position w-1, which read drafts before w-1 only. -> [B] int64."""
    B, N = a.shape
    M = sps.shape[0]
    n_live = live.sum()
    m0 = torch.where(other, length, 0).max().clamp(min=1)                   # 0-dim
    w = torch.arange(1, N + 1, device=a.device)
    gain = (a * sched[:, None]).sum(0)                                       # [N]: level w-1
    tau = tau0 + torch.cumsum(gain, 0)
    if window_sps is None:
        b = (n_live * (1 + torch.maximum(w, m0))).clamp(max=M - 1)         # [N]
        b0 = (n_live * (1 + m0)).clamp(max=M - 1)
        s_b, s0 = sps[b], sps[b0.reshape(1)]
    else:                                        # by rows and width: [rows, N] table
        r = n_live.clamp(max=window_sps.shape[0] - 1).reshape(1)          # (a 0-dim index syncs)
        s_b = window_sps[r, torch.maximum(w, m0) - 1]                      # [N]
        s0 = window_sps[r, (m0 - 1).reshape(1)]                            # [1]
    if round_ms is not None:
        s_b, s0 = _whole_round(s_b, s0, round_ms, n_live)
    s_prev = torch.cat([s0, s_b[:-1]])
    tau_prev = torch.cat([tau0[None], tau[:-1]])
    improve = (gain > 0) & (gain * s_b > tau_prev * (s_prev - s_b))
    K = torch.cumprod(improve.to(torch.int64), 0).sum()
    return torch.where(sched, K, length)


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


def censored_odds(risk: np.ndarray, surv: np.ndarray, acc: np.ndarray, ver: np.ndarray, c: np.ndarray) -> None:
    """Add to the Kaplan-Meier counts ``risk`` / ``surv`` [rows, N] (rows that reached and verified
    draft k / accepted it) what the calibrated conditional confidences ``c`` [rows, w] say of the
    drafts a row did not verify after accepting all it did (``acc == ver < w``): it reaches draft
    k >= ver with probability ``prod_{ver<=j<k} c_j`` and accepts it with ``prod_{ver<=j<=k} c_j``.
    Where each row's window is its own admitted prefix (packed rounds; a narrowed head) the
    censoring is informative: the rows verified furthest are the confident ones, and counting only
    them made the tail's conditional acceptance near 1 (replayed H100 run at batch 64: estimated
    survival 0.14 at draft 7 against the replay's ~0.1). With the head's odds the counts telescope
    to the mean survival the calibration predicts."""
    w = c.shape[1]
    k = np.arange(w)[None]                                                       # [1, w]
    open_ = (acc == ver)[:, None] & (k >= ver[:, None])                         # [rows, w]
    if not open_.any():
        return
    odds = np.cumprod(np.where(open_, c, 1.0), axis=1)                          # prod_{ver<=j<=k} c_j
    reach = np.concatenate([np.ones((len(c), 1)), odds[:, :-1]], axis=1)        # prod_{ver<=j<k} c_j
    risk[:, :w] += np.where(open_, reach, 0.0)
    surv[:, :w] += np.where(open_, odds, 0.0)


class SurvivalEstimate:
    """Prefix-survival curve of the recent speculative rounds from their verified outcomes
    (Kaplan-Meier with the verify window as censoring): per position k, ``at_risk_k`` rows reached
    draft k and verified it, ``survived_k`` of them accepted it (plus, where the round ran the head,
    the odds of the drafts its rows did not verify: ``censored_odds``); conditional acceptance
    ``h_k = (survived_k + PRIOR_WEIGHT * prior_k) / (at_risk_k + PRIOR_WEIGHT)`` and ``curve[k] =
    prod_{j<=k} h_j``. The prior ``prior_k = S_k / S_{k-1}`` is the head's own prediction of the
    conditional acceptance, known for every position whatever the window verified: ``S_k`` the mean
    over the recent confidence rounds' rows of the calibrated prefix product ``prod_{j<=k} c_{r,j}``
    (``S_{-1} = 1``), ``PRIOR`` before any. Not the mean of ``c_{r,k}`` itself: a row's confidences
    are correlated across positions (an easy continuation is easy throughout), so the rows that
    survive to k are the confident ones, and the mean conditional under-states the tail (replayed
    H200 curve: tau 1.81 against the true 2.41), which kept censored windows looking right. Before
    any confidence round ``S`` is ``measured`` where given (the calibration's held-out survival,
    ``Calibration.survival``), else the constant ``PRIOR``. Counts of the last
    ``window`` rounds; AR rounds (nothing verified) add nothing, so the estimate is not pulled
    down by them, and a few unlucky rounds at batch 1 do not read as a curve of zeros, but they
    age the window (``age``). Rounds that leave the window keep counting, decayed, in the prior
    (``HISTORY_DECAY``)."""

    PRIOR, PRIOR_WEIGHT = 0.5, 4.0
    # Rounds leaving the window join a history (each earlier round's weight times HISTORY_DECAY per
    # round that leaves after it: ~100 rounds' memory) that the prior leans on as counts: the
    # calibration's curve and the head's confidences are calibrated at one temperature, and greedy
    # requests of the default pair accept more (hazards 0.55, 0.49, 0.67, ... against the curve's
    # 0.45, 0.40, 0.40, ...: 1.23 accepted drafts a round against 0.74), which kept a batch-1 window's
    # estimate at ~0.99 and the batch in AR rounds (session 43).
    HISTORY_DECAY = 0.99
    # The AR fallback's evidence (``optimistic``): the expected accepted drafts at their one-sided
    # 95 % upper bound. A streak, once started, runs until a probe (hundreds of rounds where probes
    # are dear), so it starts only where AR wins even against that bound.
    UPPER_Z = 1.645
    # Once the window is full the curve is estimated again every REFRESH rounds, not every round:
    # each round's decisions read it, and on a round of ~1.5 ms (the default pair on the H200) the
    # estimate and the decisions that follow from it were 0.1-0.2 ms of host time; a full window
    # moves by at most REFRESH / window of its rounds in between.
    REFRESH = 4
    # ``forget`` of at least this share of the batch drops the curve at once (batch 1, 2: the next
    # round's decision is about the requests that stayed); smaller shares mark it due.
    FORGET_NOW = 0.5

    def __init__(self, num_spec_tokens: int, window: int = 32, measured: np.ndarray | None = None,
                 refresh: int = REFRESH):
        """``measured``: [<= N] a prefix-survival curve measured on held-out data; with it the
        estimate holds before any round (``informed``): a fresh scheduler decides from it.
        ``refresh``: rounds between estimates once the window is full (1: every round)."""
        self.n, self.refresh = num_spec_tokens, max(1, int(refresh))
        self.measured = None if measured is None or not len(measured) else np.asarray(measured, np.float64)
        self.rounds: deque = deque(maxlen=window)        # (at_risk [N], survived [N]) per round
        self.confidence: deque = deque(maxlen=window)    # (sum_r prod_{j<=k} c_{r,j} [N], rows)
        # running sums of both windows (the rounds' decisions read the curve every round)
        self._risk, self._surv = np.zeros(self.n), np.zeros(self.n)
        self._hist_risk, self._hist_surv = np.zeros(self.n), np.zeros(self.n)   # rounds past the window
        self._conf, self._conf_rows = np.zeros(self.n), 0
        self._curve: np.ndarray | None = None
        self._upper: np.ndarray | None = None            # ``optimistic``, of the same counts as the curve
        self._stale = 0                                  # rounds added since the curve was estimated
        self._due = False                                # the curve is to be estimated again
        self._held = False                               # prepare()d: the next add keeps the curve
        self._last_confidence: np.ndarray | None = None  # [rows, N] of the latest round with the head
        self._version = 0                                # curves dropped (``version``)
        self._pending: tuple | None = None               # a deferred add: (accepted, verified, confidence)
        self._forget_carry = 0.0                         # ``forget``'s fraction of a round not yet retired

    def __len__(self) -> int:
        return min(len(self.rounds) + (self._pending is not None), self.rounds.maxlen)

    @property
    def informed(self) -> bool:
        """Whether the curve rests on anything measured: verified rounds or the ``measured`` prior."""
        return bool(self.rounds) or self._pending is not None or self.measured is not None \
            or bool(self._hist_risk.any())

    @property
    def dropped(self) -> bool:
        """Whether the curve was dropped (the next ``curve`` estimates it)."""
        return self._curve is None

    @property
    def fresh(self) -> bool:
        """Whether no round was added yet (none in the window, deferred or in the history)."""
        return not self.rounds and self._pending is None and not self._hist_risk.any()

    @property
    def last_confidence(self) -> np.ndarray | None:
        """[rows, N] the calibrated confidences of the latest round with the head (deferred or not;
        the same array object until another such round)."""
        if self._pending is not None and self._pending[2] is not None and self._pending[2].shape[1] == self.n:
            return self._pending[2]
        return self._last_confidence

    @property
    def version(self) -> int:
        """Counts the curves dropped: each makes the next ``curve`` a new array, and the scheduler's
        decision tables (``VerifyScheduler.row_choices``) key on the array."""
        if self._pending is not None and not self._held:     # the deferred add may drop the curve
            self.flush()
        return self._version

    def add(self, accepted, verified, confidence=None, now: bool = False, defer: bool = False) -> None:
        """One round: per row, drafts accepted and drafts verified (accepted <= verified <= N);
        ``confidence`` [rows, N]: the rows' calibrated conditional confidences, if the round ran
        the head ([rows, h] of a head narrowed to h drafts: they weigh its rows' unverified drafts,
        ``censored_odds``, but leave the prior and ``last_confidence`` as they were). ``now``: the
        next ``curve`` takes this round in whatever the refresh and a ``prepare`` say (a probe of an
        AR streak, whose outcome the next decision is to read). ``defer`` (not with ``now``): keep
        the round until the estimate is next read or prepared (``Scheduler``: the next round's host
        work, while that round runs on the device), one round at most; every read returns what it
        would have after an immediate ``add``."""
        c = None
        if confidence is not None and len(confidence):
            c = np.asarray(confidence, dtype=np.float64)[:, : self.n]               # [rows, N]
        self.flush()
        if defer and not now:
            self._pending = (accepted, verified, c)
        else:
            self._add(accepted, verified, c, now)

    def flush(self) -> None:
        """Apply a deferred ``add`` now (``Scheduler``: the host work of a round that decides
        nothing, e.g. a fixed-N round, so the bookkeeping still runs while the device works)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._add(*pending, now=False)

    def _add(self, accepted, verified, c: np.ndarray | None, now: bool) -> None:
        acc, ver = np.asarray(accepted)[:, None], np.asarray(verified)[:, None]
        k = np.arange(self.n)[None]
        filling = len(self.rounds) < self.rounds.maxlen
        if not filling:
            self._retire_oldest()
        risk, surv = ((acc >= k) & (ver > k)).astype(np.float64), (acc > k).astype(np.float64)
        if c is not None:
            censored_odds(risk, surv, acc[:, 0], ver[:, 0], c)
        new = (risk.sum(0), surv.sum(0))
        self.rounds.append(new)
        self._risk, self._surv = self._risk + new[0], self._surv + new[1]
        if c is not None and c.shape[1] == self.n:       # a narrowed head's: no prior past its drafts
            if len(self.confidence) == self.confidence.maxlen:
                old_sum, old_rows = self.confidence[0]
                self._conf, self._conf_rows = self._conf - old_sum, self._conf_rows - old_rows
            self._last_confidence = c                                               # [rows, N]
            prefix = np.cumprod(c, axis=1).sum(0)                                   # [N]
            self.confidence.append((prefix, c.shape[0]))
            self._conf, self._conf_rows = self._conf + prefix, self._conf_rows + c.shape[0]
        self._stale += 1
        self._due = self._due or filling or self._stale >= self.refresh or now
        if self._due and (now or not self._held):
            self._drop()
        self._held = False

    def _retire_oldest(self) -> None:
        """The window's oldest round leaves it for the history (``HISTORY_DECAY``)."""
        old = self.rounds.popleft()
        self._risk, self._surv = self._risk - old[0], self._surv - old[1]
        self._hist_risk = self.HISTORY_DECAY * self._hist_risk + old[0]
        self._hist_surv = self.HISTORY_DECAY * self._hist_surv + old[1]

    def age(self, rounds: int) -> None:
        """``rounds`` rounds ran that verified nothing (an AR streak's): as many of the window's
        oldest rounds leave it for the history, so the window spans the batch's last ``window``
        rounds of any kind, not its last speculative ones. Without this a streak's window held
        the rows from before it for hundreds of rounds, one probe row replacing one of them every
        64 AR rounds: on the default pair at batch 1 (H100 prices replayed on the CPU, session 45)
        a hard request's zeros kept the estimate at ~0.55 accepted drafts through the next
        requests, whose probes accepted 5, 7, 3 and 7. The estimate is dropped when anything
        left (the next ``curve`` reads the history's prior and the rounds after the streak)."""
        self._retire(int(rounds))

    def forget(self, share: float) -> None:
        """A ``share`` of the batch's rows left it (finished requests): as large a share of the
        window's rounds, the oldest first, leaves for the history (a carry keeps the fractions),
        so the window speaks of the requests in the batch rather than of those before them. At
        batch 1 a finished request empties it and the next request starts from the history's
        prior (the workload's recent requests, ~100 rounds) and its own rows: the window of the
        request before it had held the next one in AR rounds that its own acceptance did not call
        for (CPU replay of the H100's prices in bf16, session 45: requests accepting 1.4-2.1
        drafts a round in fixed rounds ran 70-96 % AR rounds after two that accepted ~0.7).
        Under ``FORGET_NOW`` of the batch the curve is estimated again when it is next due (after
        a ``prepare``: in the next one, off the round's host path), not at once: at batches 8-64 a
        request finishes every round or two, and estimating on the decision path each time cost
        the scheduled mode's fixed rounds 0.06-0.14 ms (H100, 930bd39: 0.69 / 0.97 / 1.21 ms
        against fixed mode's 0.63 / 0.84 / 1.07 at 8 / 32 / 64)."""
        share = max(0.0, min(1.0, float(share)))
        self._forget_carry += share * len(self.rounds)
        n = int(self._forget_carry)
        self._forget_carry -= n
        self._retire(n, now=share >= self.FORGET_NOW)

    def _retire(self, n: int, now: bool = True) -> None:
        """The window's ``n`` oldest rounds (at most all) leave it for the history; a deferred
        ``add``, the newest round, stays deferred. ``now``: drop the curve (the next read
        estimates it); else mark it due, as a round's ``add`` does."""
        n = min(n, len(self.rounds))
        for _ in range(n):
            self._retire_oldest()
        if n > 0 and now:
            self._drop()
        elif n > 0:
            self._due = True

    def _drop(self) -> None:
        self._curve, self._upper, self._due = None, None, False
        self._version += 1

    def prepare(self) -> None:
        """Estimate the curve now, while a round runs on the device (``Scheduler``: host work
        between a round's launch and its read-back), where a refresh is due; the round's ``add``
        then keeps it, so the next round's decisions read it at no host cost on their path: an
        estimate one round older (the decisions stay a function of the batch's history). A deferred
        ``add`` is applied first."""
        self.flush()
        if self._due:
            self._drop()
        self.curve()
        self._held = True

    def prior(self) -> np.ndarray:
        """[N] the prior conditional acceptance: ``(hist_survived_k + PRIOR_WEIGHT p_k) /
        (hist_at_risk_k + PRIOR_WEIGHT)`` of the rounds past the window (``HISTORY_DECAY``; none
        until the window is full) around ``p_k``, the ratio ``S_k / S_{k-1}`` of the head's mean
        calibrated prefix products ``S``, else of the ``measured`` curve, else ``PRIOR``; where
        ``S_{k-1}`` vanishes (or the measured curve ends), the previous position's."""
        p = self._external_prior()
        if not self._hist_risk.any():
            return p
        den = self._hist_risk + self.PRIOR_WEIGHT
        return np.divide(self._hist_surv + self.PRIOR_WEIGHT * p, den, out=p.copy(), where=den > 0)

    def _external_prior(self) -> np.ndarray:
        self.flush()
        if self.confidence:
            s = self._conf / self._conf_rows                                        # [N] S_k
        elif self.measured is not None:
            s = np.full(self.n, np.nan)
            s[: len(self.measured)] = self.measured[: self.n]
        else:
            return np.full(self.n, self.PRIOR)
        prev = np.concatenate([[1.0], s[:-1]])
        ratio = np.divide(s, prev, out=np.full(self.n, np.nan), where=prev > 1e-12)
        if not np.isfinite(ratio).all():
            for k in range(self.n):              # S_{k-1} ~ 0: carry the last defined hazard
                if not np.isfinite(ratio[k]):
                    ratio[k] = ratio[k - 1] if k else self.PRIOR
        return np.clip(ratio, 0.0, 1.0)

    def curve(self) -> np.ndarray:
        """[N] float64 prefix-survival estimate (cached until the next ``add``; with a full window
        for ``refresh`` rounds; after ``prepare`` until the round after next). A deferred ``add``
        waits where it would keep the curve (after ``prepare``), else is applied first."""
        if self._pending is not None and not self._held:
            self.flush()
        if self._curve is None:
            self._curve, self._upper, self._stale = self._estimate(), None, 0
        return self._curve

    def optimistic(self) -> np.ndarray:
        """[N] the curve (``curve``) scaled up so that its expected accepted drafts per row, ``mu =
        sum_k s_k``, sit at their one-sided 95 % upper bound ``mu + UPPER_Z sqrt(var / n)`` (each
        entry at most 1): ``var = sum_k (2k + 1) s_k - mu^2`` the variance of a row's accepted
        count under the curve, ``n`` the rows behind ``s_0`` (``at_risk_0 + PRIOR_WEIGHT``). What
        the AR fallback decides from (``Scheduler._falls_back_to_ar``): a window of batch-1 rounds
        is a few dozen rows, whose estimate dips on a few hard requests, and each dip would start
        an AR streak that its dear probes keep for hundreds of rounds (H100, default pair, batch 1:
        205 AR rounds to 123 speculative where fixed rounds beat AR by 1.19x); thousands of rows
        (batch 64) move it by a few percent. Before any verified row the prior alone, as the
        ``PRIOR_WEIGHT`` rows it weighs in the curve: the calibration's held-out survival was
        measured at its own temperature and prompts (the default pair's at temperature 1: 0.74
        accepted drafts a round, where greedy requests accepted 1.24 on an H100 in session 43),
        and taken as exact it started batch 1 in an AR streak that its probes rarely ended (765
        AR rounds to 45 speculative; scheduled / fixed N 0.76-0.88)."""
        curve = self.curve()
        if self._upper is None:
            mu, k = float(curve.sum()), np.arange(self.n)
            rows = self._risk[0] + self.PRIOR_WEIGHT
            if mu <= 0.0 or rows <= 0:
                self._upper = curve
            else:
                var = max(float(((2 * k + 1) * curve).sum()) - mu * mu, 0.0)
                se = np.sqrt(var / rows)
                self._upper = np.minimum(curve * (1.0 + self.UPPER_Z * se / mu), 1.0)
        return self._upper

    def _estimate(self) -> np.ndarray:
        at_risk, survived = self._risk, self._surv
        prior, den = self.prior(), at_risk + self.PRIOR_WEIGHT
        h = np.where(den > 0, (survived + self.PRIOR_WEIGHT * prior) / np.maximum(den, 1e-12),
                     prior)                         # nothing seen at k (no prior weight): the prior
        return np.cumprod(h)
