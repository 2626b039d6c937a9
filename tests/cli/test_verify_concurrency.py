"""benchmarks/verify_concurrency.py: the synthetic acceptance replays its survival curve, and a
tiny run writes the JSON + PNG with every mode (random weights, synthetic confidence)."""
from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from tests.support.benchmark_scripts import load_benchmark


def _module():
    return load_benchmark("verify_concurrency")


def test_synthetic_acceptance_replays_the_survival_curve():
    """spread 0: every row's conditional acceptance is the curve's p_k; over 20000 rows the
    per-position survival is within 4.4 sigma of the curve (two-sided alpha ~ 1e-5 per position)."""
    mod = _module()
    survival = [0.45, 0.18, 0.07, 0.03]
    B, N, V = 20000, 4, 5
    nets = SimpleNamespace(num_spec_tokens=N, device=torch.device("cpu"),
                           verify=lambda *a: None)
    syn = mod.SyntheticAcceptance(nets, survival, spread=0.0)
    seed, start = torch.arange(B), torch.full((B,), 7)
    logits = torch.zeros(B, N + 1, V)
    acc, nxt = syn.verify(logits, torch.zeros(B, N, dtype=torch.int64), None, torch.zeros(B), seed, start)
    for k, s in enumerate(survival):
        got = (acc > k).double().mean().item()
        assert abs(got - s) < 4.4 * (s * (1 - s) / B) ** 0.5, (k, got, s)
    conf = syn._conf_logits(seed, start, N)                     # confidence = logit(p_k) exactly
    assert torch.allclose(torch.sigmoid(conf[0]), torch.tensor([0.45, 0.4, 7 / 18, 3 / 7]), atol=1e-5)
    assert nxt.shape == (B,)


@pytest.mark.parametrize("spread", [1.0, 2.0])
def test_synthetic_acceptance_with_a_spread_keeps_the_curves_survival(spread):
    """Correlated rows (one logistic offset per row): the per-position logits are solved so that the
    mean prefix survival is still the curve's: over 20000 rows within 4.4 sigma of it per position
    (rows independent; two-sided alpha ~ 1e-5 per position). ``logit(p_k)`` at this spread gives a
    tail several times heavier (what the replay ran before: tau 2.42 for the curve's 1.75)."""
    import numpy as np
    mod = _module()
    survival = [0.45, 0.179, 0.072, 0.027, 0.008, 0.004, 0.003]
    B, N, V = 20000, 7, 5
    nets = SimpleNamespace(num_spec_tokens=N, device=torch.device("cpu"), verify=lambda *a: None)
    syn = mod.SyntheticAcceptance(nets, survival, spread=spread)
    seed, start = torch.arange(B), torch.full((B,), 3)
    acc, _ = syn.verify(torch.zeros(B, N + 1, V), torch.zeros(B, N, dtype=torch.int64), None,
                        torch.zeros(B), seed, start)
    for k, s in enumerate(survival):
        got = (acc > k).double().mean().item()
        assert abs(got - s) < 4.4 * (s * (1 - s) / B) ** 0.5, (k, got, s)
    rows = mod.synthetic_rows(np.random.default_rng(0), 200_000, mod.replay_logits(survival, N, spread), spread)
    np.testing.assert_allclose(np.cumprod(rows, axis=1).mean(0), survival, rtol=0.1)
    cond = np.asarray(mod.conditional_acceptance(survival, N))
    heavy = np.cumprod(mod.synthetic_rows(np.random.default_rng(0), 200_000, np.log(cond / (1 - cond)), spread), 1)
    assert heavy.mean(0)[-1] > 10 * survival[-1]


def test_tiny_run_writes_json_and_plot(tmp_path):
    mod = _module()
    calib = tmp_path / "cal.json"
    calib.write_text(json.dumps({"before": {"per_position": [{"label_mean": v} for v in (0.5, 0.2, 0.1)]}}))
    assert mod.main(["--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                     "--batch-sizes", "1,2", "--gen-len", "6", "--prompt-len", "8", "--iters", "1",
                     "--synthetic", str(calib), "--modes", "fixed,scheduled,threshold,packed,auto",
                     "--round-kinds", "--compile", "aot_eager", "--out-dir", str(tmp_path / "out")]) == 0
    path = next((tmp_path / "out").glob("verify-concurrency-*.json"))
    report = json.loads(path.read_text())
    assert report["model"]["step_path"] == {"engine": False, "fused_projections": True, "compiled": "aot_eager"}
    assert report["confidence"].startswith(f"synthetic, replayed from {calib}")
    assert report["starting_survival"] == [0.5, 0.2, 0.1]          # the replayed curve, as calibrated
    assert path.with_suffix(".png").exists()
    n = report["model"]["num_spec_tokens"]
    for row in report["batch"].values():
        assert set(row) == {"fixed", "scheduled", "threshold", "packed", "auto", "autoregressive", "round_kinds"}
        for m in ("fixed", "scheduled", "threshold", "packed", "auto"):
            assert row[m]["decode_tokens_per_s"] > 0 and 1 <= row[m]["verified_per_round"] <= n + 1
            assert 1 <= row[m]["mean_verify_window"] <= n
        assert not row["fixed"]["verify_slots"] and not row["scheduled"]["verify_slots"]
        kinds = row["round_kinds"]
        assert 1 <= kinds["estimated_window"] <= n
        assert all(kinds[f"{k}_ms"] > 0 for k in ("fixed", "confidence", "estimated", "packed"))
    assert {"packed_over_fixed_at_largest_batch", "scheduled_over_fixed_at_largest_batch"} <= set(report["goal_issue_25"])
    # results over 4 KB are kept gzipped: --plot draws them again from the .json.gz
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    path.with_suffix(".png").unlink()
    assert mod.main(["--plot", str(gz)]) == 0 and path.with_suffix(".png").stat().st_size > 0


def test_round_kinds_run_without_the_scheduled_mode(tmp_path):
    """--round-kinds times the kinds whenever a confidence mode is among --modes (packed alone
    here): session 39's fixed,packed run printed none because they needed "scheduled"."""
    mod = _module()
    calib = tmp_path / "cal.json"
    calib.write_text(json.dumps({"before": {"per_position": [{"label_mean": v} for v in (0.5, 0.2, 0.1)]}}))
    assert mod.main(["--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                     "--batch-sizes", "2", "--gen-len", "4", "--prompt-len", "8", "--iters", "1",
                     "--synthetic", str(calib), "--modes", "fixed,packed", "--round-kinds", "--compile", "aot_eager",
                     "--out-dir", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("verify-concurrency-*.json")).read_text())
    kinds = report["batch"]["2"]["round_kinds"]
    assert kinds["fixed_ms"] > 0 and kinds["packed_ms"] > 0


def test_steady_load_keeps_the_concurrency_and_stays_lossless(monkeypatch):
    """--load steady: every round of the window runs B requests (each finished one replaced at
    once), all waves x B prompts are submitted, and the speculative requests' greedy outputs equal
    the AR ones of the same prompts (the replacement path is lossless)."""
    mod = _module()
    from dspark_trt.commands import bench
    args = mod.parse_args(["--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                           "--batch-sizes", "3", "--prompt-len", "8", "--gen-len", "6"])
    args.max_batch_size, args.max_seq_len = 3, 8 + 9        # prompt + the longest steady length
    llm = bench.load_llm(args)
    prompts = bench.make_prompts(llm, "random", 12, 8, 0)
    from dspark_trt.runtime.scheduler import Scheduler
    running, step = [], Scheduler.step

    def counting_step(self):
        running.append(len([s for s in self.running if s.finish_reason is None]) + len(self.waiting))
        return step(self)

    monkeypatch.setattr(Scheduler, "step", counting_step)
    outs, calls, add = {}, [], Scheduler.add_request
    monkeypatch.setattr(Scheduler, "add_request",
                        lambda self, *a, **k: calls.append(add(self, *a, **k)) or calls[-1])
    for spec in (True, False):
        running.clear()
        calls.clear()
        r = mod.steady_state(llm, prompts, 3, 6, spec)
        assert r["requests_submitted"] == 12 and r["window_tokens"] > 0 and r["rounds"] > 0
        # the window admits the 12 - 3 later requests, minus those admitted after the last submission
        assert 1 <= r["prefill_calls"] <= r["prefill_requests"] <= 9 and 0 < r["prefill_share"] < 1
        assert all(n == 3 for n in running[1:-1]), running      # B in flight but at the last step
        # the window's rounds as the Scheduler timed them: one kind per mode, every round counted
        wall = r["round_wall"]
        assert set(wall) == ({"fixed"} if spec else {"ar"}) and wall[next(iter(wall))]["count"] == r["rounds"]
        assert all(0 < v["median_ms"] <= v["max_ms"] and 0 < v["mean_rows"] <= 3 for v in wall.values())
        outs[spec] = {tuple(s.prompt_ids): s.output_ids for s in calls if s.finish_reason == "length"}
    both = outs[True].keys() & outs[False].keys()
    assert len(both) >= 6 and all(outs[True][p] == outs[False][p] for p in both)
    lengths = mod.steady_lengths(12, 6)
    assert lengths == mod.steady_lengths(12, 6) and min(lengths) >= 3 and max(lengths) <= 9
    assert len(set(lengths)) > 1                   # requests end at different rounds, AR included
    assert all(len(outs[False][p]) == lengths[i] for i, p in enumerate(map(tuple, prompts.tolist()))
               if p in outs[False])


def test_steady_load_seeds_requests_for_common_random_numbers(tmp_path):
    """Request i samples with ``request_seed(run seed, i)`` in every mode, so the synthetic
    acceptance (keyed by seed and position) gives two runs of the same rounds the same outcomes:
    equal accepted counts per request; another run seed draws other outcomes."""
    mod = _module()
    from dspark_trt.commands import bench
    from dspark_trt.runtime.scheduler import Scheduler
    args = mod.parse_args(["--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                           "--batch-sizes", "3", "--prompt-len", "8", "--gen-len", "8"])
    args.max_batch_size, args.max_seq_len = 3, 8 + 12
    llm = bench.load_llm(args)
    llm.networks = mod.SyntheticAcceptance(llm.networks, [0.6, 0.4, 0.3, 0.2], spread=1.0)
    llm._steps = None
    prompts = bench.make_prompts(llm, "random", 12, 8, 0)
    accepted, add = [], Scheduler.add_request

    def run(seed):
        accepted.clear()
        Scheduler.add_request = lambda self, *a, **k: accepted.append(add(self, *a, **k)) or accepted[-1]
        try:
            mod.steady_state(llm, prompts, 3, 8, True, "fixed", seed)
        finally:
            Scheduler.add_request = add
        assert [s.seed for s in accepted] == [mod.request_seed(seed, i) for i in range(len(accepted))]
        return [list(s.stats.accepted) for s in accepted]

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def test_schedule_bounds_of_a_cost_grid():
    """``fallback_decision.bounds``: spread 0 keeps the curve as the batch survival; on a grid
    where 64 rows x 7 drafts cost 3x the 1-draft verify, the best window trims and the per-row
    oracle beats it; on a flat grid the full window is best and nothing beats the fixed round by
    more than the oracle's rounding."""
    import sys
    mod = load_benchmark("fallback_decision")
    assert "verify_concurrency" in sys.modules
    survival = [0.45, 0.18, 0.07, 0.03]
    n, rows = 4, [1, 64]

    def result(grid):
        return {"model": {"num_spec_tokens": n},
                "cost_curve": {"tokens": [2, 320], "latency_ms": [1.0, 3.0], "rows": rows, "draft_ms": [0.2, 0.4],
                               "ar_ms": [1.0, 1.5], "verify_ms": grid},
                "batch": {"64": {"fixed": {"decode_tokens_per_s": 100.0}, "scheduled": {"decode_tokens_per_s": 90.0}}}}

    steep = mod.bounds(result([[1.0] * n, [4.0, 6.0, 9.0, 12.0]]), survival, spread=0.0)
    assert abs(steep["survival"][0] - 0.45) < 0.01 and abs(steep["survival"][2] - 0.07) < 0.01
    b64 = steep["batch"]["64"]
    assert b64["best_window"] < n and b64["window_over_fixed"] > 1.1
    assert b64["packed_oracle_over_fixed"] >= b64["window_over_fixed"] - 0.02
    assert abs(b64["measured_scheduled_over_fixed"] - 0.9) < 1e-9
    flat = mod.bounds(result([[1.0] * n, [1.0] * n]), survival, spread=1.0)["batch"]["64"]
    assert flat["best_window"] == n and flat["window_over_fixed"] == 1.0
    assert flat["packed_oracle_over_fixed"] < 1.05


def test_modes_are_checked_before_the_model_loads():
    mod = _module()
    for modes, msg in (("scheduled", "must include 'fixed'"), ("fixed,sched", r"unknown \['sched'\]")):
        with pytest.raises(SystemExit, match=msg):
            mod.run(["--device", "cpu", "--modes", modes, "--batch-sizes", "1"])
    with pytest.raises(SystemExit, match="--profile-kinds profiles the --round-kinds rounds"):
        mod.run(["--device", "cpu", "--modes", "fixed", "--batch-sizes", "1", "--profile-kinds"])


def test_repeats_keep_the_median_run_and_pair_the_ratios():
    """--repeats: a mode's row is its median run by tokens/s (the lower middle one of an even
    count) with every run's tokens/s; ratios pair the runs of one repeat."""
    mod = _module()
    runs = [{"decode_tokens_per_s": v, "tag": i} for i, v in enumerate((30.0, 10.0, 20.0))]
    rec = mod.repeated(runs)
    assert rec["tag"] == 2 and rec["decode_tokens_per_s_repeats"] == [30.0, 10.0, 20.0]
    assert mod.repeated(runs[:2])["tag"] == 1                     # even count: the lower middle
    assert "decode_tokens_per_s_repeats" not in mod.repeated(runs[:1])
    ar = [{"decode_tokens_per_s": v} for v in (15.0, 10.0, 40.0)]
    assert mod.paired_ratios(runs, ar) == [2.0, 1.0, 0.5]
    for r, v in zip(runs + ar, (6.0, 2.0, 4.0, 3.0, 4.0, 2.0)):             # steady loads: decode alone too
        r["decode_only_tokens_per_s"] = v
    assert mod.paired_ratios(runs, ar, "decode_only_tokens_per_s") == [2.0, 0.5, 2.0]
    assert mod.paired_ratios(runs, ar + [{}], "missing") == []


def test_prices_replay_a_runs_cost_curve(tmp_path):
    """``--prices``: the cost curve of a results JSON (gzipped too) or a verify_cost.json, as that run
    measured it; a file without one, or a broken one, is refused naming the file."""
    from dspark_trt.runtime.cost_curve import CostCurve
    mod = _module()
    pts = dict(tokens=[2, 16], latency_ms=[0.4, 1.0], rows=[1, 4], draft_ms=[0.1, 0.2], ar_ms=[0.3, 0.5])
    (tmp_path / "run.json.gz").write_bytes(gzip.compress(json.dumps({"cost_curve": pts, "batch": {}}).encode()))
    (tmp_path / "verify_cost.json").write_text(json.dumps(pts))
    for name in ("run.json.gz", "verify_cost.json"):
        curve = mod.load_prices(str(tmp_path / name))
        assert isinstance(curve, CostCurve) and curve.ar_ms == [0.3, 0.5] and name in curve.source
        assert curve.step_ms("ar", 4) == 0.5
    (tmp_path / "none.json").write_text(json.dumps([1, 2]))
    (tmp_path / "bad.json").write_text(json.dumps({"cost_curve": {**pts, "latency_ms": [0.4]}}))
    for name in ("none.json", "bad.json", "missing.json"):
        with pytest.raises(SystemExit, match=name):
            mod.load_prices(str(tmp_path / name))
