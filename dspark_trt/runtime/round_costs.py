"""What the rounds the AR fallback weighs cost under the running load, against their price.

The AR fallback (``VerifyScheduler.prefers_ar``) prices an AR round and each speculative option
from the measured cost curve (``verify_cost.json``: each step timed alone). A round under load
also pays what the curve leaves out or measured under other conditions: the Scheduler's Python
between the steps, the deferred draft context a speculative round writes first, another process
on the same cores. On the 2-core CPU with the default pair one curve priced the AR round at 25.3
ms and the fixed round at 38.0 ms at batch 1 (132.6 / 350.6 ms at 64), and the steady load ran
them at 14.3 / 28.5 ms (72.1 / 299.4): AR was over-priced against drafting
(verify-concurrency-cpu-fixed-prices-steady-2e4d1c5.json.gz).

``RoundCosts`` keeps, per kind ("ar": the fallback's AR rounds; "fixed", "window",
"confidence": the speculative rounds, ``VerifyScheduler.option_kind``) and row count, an
exponential average of observed over priced wall time, and ``prefers_ar`` scales each option's
price by it once ``MIN_ROUNDS`` rounds of that kind were seen (until then by the fixed rounds').
Host wall times differ between processes, so a tensor-parallel group, whose ranks must take the
same decision, does not learn (``LLM``). Opt-in (``LLM(learn_round_costs=True)``,
``verify_concurrency.py --learn-round-costs``): on the CPU its runs were within the run-to-run
noise of the curve's prices (docs/confidence.md).
"""
from __future__ import annotations

import math

ALPHA = 0.25              # weight of the newest round in the average
MIN_ROUNDS = 3            # rounds of a kind (at a row count) before its scale is used
SCALE_RANGE = (0.25, 4.0)  # a round whose wall is far off (a GC pause, a first call) moves the average at most this far


class RoundCosts:
    """Observed / priced wall time of the Scheduler's rounds, per (kind, rows)."""

    def __init__(self):
        self._ratio: dict[tuple[str, int], tuple[float, int]] = {}   # -> (average, rounds seen)

    def observe(self, kind: str, rows: int, wall_ms: float, priced_ms: float) -> None:
        if not (priced_ms > 0 and math.isfinite(wall_ms) and wall_ms > 0):
            return
        r = min(max(wall_ms / priced_ms, SCALE_RANGE[0]), SCALE_RANGE[1])
        avg, n = self._ratio.get((kind, rows), (r, 0))
        self._ratio[(kind, rows)] = (avg + ALPHA * (r - avg), n + 1)

    def scale(self, kind: str, rows: int, prior: str | None = None) -> float:
        """The factor the price of a ``kind`` round at ``rows`` rows takes: its average once seen
        ``MIN_ROUNDS`` times, else ``prior``'s (another kind's), else 1."""
        avg, n = self._ratio.get((kind, rows), (1.0, 0))
        if n >= MIN_ROUNDS:
            return avg
        return self.scale(prior, rows) if prior and prior != kind else 1.0

    def rounds(self, kind: str, rows: int) -> int:
        return self._ratio.get((kind, rows), (1.0, 0))[1]
