"""benchmarks/schedule_bound.py: the bound a verify_concurrency result allows the scheduler (issue #25)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_trt.runtime.verify_scheduler import SCHEDULER_ROW_MS, VerifyScheduler
from tests.support.benchmark_scripts import load_benchmark

N = 4
SURVIVAL = [0.5, 0.3, 0.2, 0.1]


def _report(synthetic: bool, ar_ms=(1.0, 3.0)) -> dict:
    """A verify_concurrency-shaped result: verify latency 1 ms + 0.01 ms per token, draft 0.5 ms,
    AR ``ar_ms`` at 1 / 64 rows, no host time; fixed and scheduled measured at batch 1 and 64."""
    tokens = [1, 8, 64, 128, 256, 320, 512]
    cost = {"tokens": tokens, "latency_ms": [1.0 + 0.01 * t for t in tokens], "rows": [1, 64],
            "draft_ms": [0.5, 0.5], "ar_ms": list(ar_ms), "admission_ms": [0.0, 0.0], "host_ms": [0.0, 0.0]}
    mode = lambda tps, share: {"decode_tokens_per_s": tps, "decode_only_tokens_per_s": tps / (1 - share),  # noqa: E731
                               "prefill_share": share}
    batch = {str(b): {"fixed": mode(100.0, 0.25), "scheduled": mode(110.0, 0.25)} for b in (1, 64)}
    return {"git_sha": "x", "gpu": "cpu", "starting_survival": SURVIVAL, "cost_curve": cost, "batch": batch,
            "options": {"synthetic": "cal.json" if synthetic else None, "spread": 1.0}}


def test_total_ratio_weights_the_decode_ratio_by_the_prefill_share():
    mod = load_benchmark("schedule_bound")
    assert mod.total_ratio(1.0, 0.4) == pytest.approx(1.0)
    assert mod.total_ratio(1.5, 0.0) == pytest.approx(1.5)
    assert mod.total_ratio(2.0, 0.5) == pytest.approx(1 / (0.5 + 0.25))


def test_prefix_survival_without_spread_is_the_curve_and_with_spread_keeps_its_mean_order():
    """spread 0: every row's prefix survival is the curve itself; spread 1: rows differ, each row's
    survival falls along it (a prefix-closed admission), and 20000 rows' mean still falls."""
    mod = load_benchmark("schedule_bound")
    p = mod.prefix_survival(SURVIVAL, N, 0.0, 100)
    np.testing.assert_allclose(p, np.tile(SURVIVAL, (100, 1)), rtol=1e-9)
    q = mod.prefix_survival(SURVIVAL, N, 1.0, 20000)
    assert q[:, 0].std() > 0.1
    assert (np.diff(q, axis=1) <= 0).all() and (np.diff(q.mean(0)) < 0).all()


def test_bound_prices_every_window_and_the_per_row_oracle_is_at_least_the_dense_windows():
    """Where every row is alike (spread 0) per-row admission can still admit whole windows, so its best
    is at least every dense window's rate at the same prices (full draft, admission, latency of
    B (1 + w)); with
    rows that differ (spread 1) it admits the likely rows' drafts first and does better still. AR at
    1 ms against a fixed round of 0.5 + 1.05 ms, each plus the scheduler's per-row host time o:
    AR over fixed = (1.55 + o) / ((1 + o) (1 + sum s)) at batch 1."""
    o = lambda B: SCHEDULER_ROW_MS * B  # noqa: E731
    admission = VerifyScheduler(N, 64, "cpu").admission_overhead_ms          # (the curve's device share: 0)
    mod = load_benchmark("schedule_bound")
    flat = _report(synthetic=True)
    flat["options"]["spread"] = 0.0
    res = mod.bound(flat, rows_mc=2000)
    one, big = res["batch"]["1"], res["batch"]["64"]
    assert one["ar_over_fixed"] == pytest.approx((1.55 + o(1)) / ((1 + o(1)) * (1 + sum(SURVIVAL))), rel=1e-6)
    assert one["best_window_over_fixed"] >= 1.0 and big["best_window_over_fixed"] >= 1.0
    for B in (1, 64):
        dense = max((1 + sum(SURVIVAL[:w])) / (0.5 + admission + 1.0 + 0.01 * B * (1 + w) + o(B))
                    for w in range(1, N + 1))
        assert res["batch"][str(B)]["packed_oracle"]["tokens_per_row_ms"] >= dense * (1 - 1e-9)
    spread = mod.bound(_report(synthetic=True), rows_mc=2000)["batch"]["64"]
    assert spread["packed_oracle_over_fixed"] > big["packed_oracle_over_fixed"]
    assert big["measured_scheduled_over_fixed"] == pytest.approx(1.1)
    assert big["total_bound_best_window"] == pytest.approx(
        mod.total_ratio(max(big["best_window_over_fixed"], big["ar_over_fixed"]), 0.25))


def test_main_writes_json_and_rejects_a_file_without_a_cost_curve(tmp_path, capsys):
    mod = load_benchmark("schedule_bound")
    src = tmp_path / "verify-concurrency-x.json"
    src.write_text(json.dumps(_report(synthetic=False)))
    assert mod.main([str(src), "--out-dir", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "schedule-bound-verify-concurrency-x.json").read_text())
    assert out["synthetic"] is False and "packed_oracle" not in out["batch"]["64"]       # no per-row model
    assert out["mean_survival"] == SURVIVAL
    assert "[bound] B= 64" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batch": {"1": {}}, "starting_survival": SURVIVAL}))
    with pytest.raises(SystemExit, match="bad.json: not a verify_concurrency result with a cost curve"):
        mod.main([str(bad), "--out-dir", str(tmp_path / "out")])
