"""The verify cost curve (``CostCurve``): step latencies vs verified tokens and rows, what the
scheduled mode prices its rounds by.

File (JSON, next to a draft checkpoint or in an engine directory):
``verify_cost.json``             {"tokens": [n_1 < n_2 < ...], "latency_ms": [...], "source": ...}
                                 (verify-step latency vs total verified tokens; ``dspark-trt bench
                                 --cost-curve`` measures it; linear interpolation between points,
                                 linear extrapolation beyond the last two)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..atomic_write import write_json_atomic
from ..checkpoints.files import COST_FILE
from .confidence import ConfidenceFileError, read_json_file


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

    def save(self, directory: str | Path, name: str = COST_FILE) -> Path:
        return write_json_atomic(Path(directory) / name, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        d = read_json_file(Path(path))
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
    def find(cls, *directories, name: str = COST_FILE) -> "CostCurve":
        """The curve in the first of ``directories`` holding ``name`` (``checkpoints.files.cost_file``),
        else the default."""
        for d in directories:
            if d is not None and (Path(d) / name).exists():
                return cls.load(Path(d) / name)
        return cls.default()
