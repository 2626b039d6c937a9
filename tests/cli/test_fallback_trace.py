"""benchmarks/fallback_trace.py: the batch-1 per-request report (issue #25)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.benchmark_scripts import load_benchmark


def _seq(accepted: list[int], proposed: list[int]) -> SimpleNamespace:
    """A finished request's stats: per round drafts accepted and verified (0 verified: an AR round),
    tokens committed (accepted + 1)."""
    return SimpleNamespace(stats=SimpleNamespace(accepted=accepted, proposed=proposed,
                                                 committed=[a + 1 for a in accepted]))


def test_per_request_prices_each_request_both_ways_and_its_oracle():
    """Request 0 drafts well (fixed N wins, the scheduled run drafted too); request 1 accepts nothing
    (AR wins: its oracle is 1 token per AR round), and the scheduled run went AR after one round."""
    mod = load_benchmark("fallback_trace")
    walls = {"ar": 0.25, "fixed": 0.5}
    fixed = [_seq([3, 3, 1], [7, 7, 7]), _seq([0, 0, 0, 0], [7, 7, 7, 7])]
    scheduled = [_seq([3, 3, 1], [7, 7, 7]), _seq([0, 0, 0, 0], [7, 0, 0, 0])]
    rows = mod.per_request(scheduled, fixed, walls)
    assert [r["request"] for r in rows] == [0, 1]
    assert rows[0]["fixed_accepted"] == pytest.approx(7 / 3) and rows[0]["fixed_ms"] == pytest.approx(1.5)
    assert (rows[0]["ar_rounds"], rows[0]["spec_rounds"], rows[0]["pattern"]) == (0, 3, "331")
    assert rows[0]["oracle_ms"] == pytest.approx(1.5)                     # fixed N: 10 tokens in 1.5 ms < 2.5
    assert (rows[1]["ar_rounds"], rows[1]["spec_rounds"], rows[1]["pattern"]) == (3, 1, "0AAA")
    assert rows[1]["scheduled_ms"] == pytest.approx(0.5 + 3 * 0.25)
    assert rows[1]["oracle_ms"] == pytest.approx(4 * 0.25)                # AR: 4 tokens in 1 ms < 2 ms
