"""benchmarks/verify_concurrency.py: the synthetic acceptance replays its survival curve, and a
tiny run writes the JSON + PNG with every mode (random weights, synthetic confidence)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("verify_concurrency", REPO / "benchmarks" / "verify_concurrency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_tiny_run_writes_json_and_plot(tmp_path):
    mod = _module()
    calib = tmp_path / "cal.json"
    calib.write_text(json.dumps({"before": {"per_position": [{"label_mean": v} for v in (0.5, 0.2, 0.1)]}}))
    assert mod.main(["--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
                     "--batch-sizes", "1,2", "--gen-len", "6", "--prompt-len", "8", "--iters", "1",
                     "--synthetic", str(calib), "--out-dir", str(tmp_path / "out")]) == 0
    path = next((tmp_path / "out").glob("verify-concurrency-*.json"))
    report = json.loads(path.read_text())
    assert report["confidence"].startswith(f"synthetic, replayed from {calib}")
    assert path.with_suffix(".png").exists()
    n = report["model"]["num_spec_tokens"]
    for row in report["batch"].values():
        assert set(row) == {"fixed", "scheduled", "threshold", "autoregressive"}
        for m in ("fixed", "scheduled", "threshold"):
            assert row[m]["decode_tokens_per_s"] > 0 and 1 <= row[m]["verified_per_round"] <= n + 1
            assert 1 <= row[m]["mean_verify_window"] <= n
