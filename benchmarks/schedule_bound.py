"""How far can confidence scheduling get? The bound a ``verify_concurrency.py`` result allows (issue #25).

Reads a ``verify_concurrency.py`` JSON: the cost curve its scheduler decided with (measured on that GPU)
and the acceptance it ran. With ``--synthetic`` runs the acceptance is known exactly: each row's
conditional acceptance ``q_k = sigmoid(b_k + spread * logit(u))`` for a uniform ``u`` per row and
round (``SyntheticAcceptance``, ``replay_logits``), drawn here by Monte Carlo; otherwise only the mean
survival curve (``starting_survival``) is known. Per batch B it prices, in committed tokens per row per ms:

* AR (``ar_ms`` + the round's host time) and every verify window w (``VerifyScheduler.option_ms``: the
  scheduler's own round prices, draft + verify of B x (1 + w) + host, with its probe rounds) at the
  mean survival: the best window over fixed N is what the trimmed scheduler, one window a round,
  can at best reach on these prices;
* (synthetic only) per-row admission with exact confidences: each round the batch's draft positions in
  order of their exact prefix survival (Algorithm 1's greedy admission, the packed model) up to the
  token count that pays best, priced as the full draft + the dense verify of as many tokens
  (``latency``) + host + admission. The packed verify measured dearer than that (the slots' attention
  and the full draft), so this bounds the packed model from above.

and the totals those decode ratios allow at the run's admission-prefill share ``p`` (steady load:
``total = 1 / (p + (1 - p) / decode)``), beside what the run measured. Writes
``schedule-bound-<run's file name>.json``.

    python benchmarks/schedule_bound.py RESULT.json[.gz] [--rows 20000] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402
from dspark_trt.runtime.cost_curve import CostCurve  # noqa: E402
from dspark_trt.runtime.verify_scheduler import VerifyScheduler  # noqa: E402


def prefix_survival(survival: list[float], n: int, spread: float, rows: int, seed: int = 0) -> np.ndarray:
    """[rows, n] each row's exact prefix survival ``prod_{j<=k} q_j`` under the synthetic acceptance
    (``SyntheticAcceptance``: one logistic offset per row and round)."""
    q = vc.synthetic_rows(np.random.default_rng(seed), rows, vc.replay_logits(survival, n, spread), spread)
    return np.cumprod(q, axis=1)


def packed_oracle(sched: VerifyScheduler, rows: int, prefix: np.ndarray, rounds: int = 200,
                  seed: int = 1) -> dict:
    """Per-row admission with exact prefix survivals (``prefix [R, N]``) at ``rows`` rows: rounds of
    ``rows`` rows drawn from ``prefix``, each admitting its ``E`` most probable draft positions (a prefix
    of every row, as the survivals fall along a row), one ``E`` for all rounds, the best; priced as
    the fixed round with the verify of ``rows + E`` tokens in place of the full window, plus admission."""
    n = prefix.shape[1]
    pick = np.random.default_rng(seed).integers(0, len(prefix), size=(rounds, rows))
    top = np.sort(prefix[pick].reshape(rounds, -1), axis=1)[:, ::-1]             # [rounds, rows * n]
    gained = np.concatenate([[0.0], np.cumsum(top, axis=1).mean(0)])             # expected drafts by E
    base = float(sched.option_ms(rows)[-1]) - sched.cost.window_ms(rows, n) + sched.admission_ms(rows)
    rates = [(rows + gained[e]) / rows / (base + sched.cost.latency(rows + e)) for e in range(rows * n + 1)]
    e = int(np.argmax(rates))
    return {"drafts_admitted_per_row": e / rows, "tokens_per_row_ms": rates[e],
            "round_ms": base + sched.cost.latency(rows + e)}


def total_ratio(decode_ratio: float, prefill_share: float) -> float:
    """Steady-load tokens/s ratio of a mode whose decode runs ``decode_ratio`` x faster, at the
    reference's admission-prefill share of the time."""
    return 1.0 / (prefill_share + (1.0 - prefill_share) / decode_ratio)


def bound(report: dict, rows_mc: int = 20000) -> dict:
    """Per batch: the priced options, the bounds and what the run measured."""
    n = len(report["starting_survival"])
    rows = max(int(b) for b in report["batch"])
    sched = VerifyScheduler(n, rows * (n + 1), "cpu", None, CostCurve.from_json(report["cost_curve"], "cost_curve"))
    synthetic = report.get("options", {}).get("synthetic")
    spread = float(report.get("options", {}).get("spread", 1.0))
    prefix = prefix_survival(report["starting_survival"], n, spread, rows_mc) if synthetic else None
    survival = prefix.mean(0) if prefix is not None else np.asarray(report["starting_survival"][:n], float)
    out = {}
    for b, modes in report["batch"].items():
        B = int(b)
        windows = dict(sched.spec_options(B, survival))
        fixed = windows[n]
        ar = 1.0 / sched.priced_ms("ar", B)                     # the AR step + host
        best = max(windows, key=windows.get)
        p = modes.get("fixed", {}).get("prefill_share", 0.0)
        row = {"ar_tokens_per_row_ms": ar, "windows_tokens_per_row_ms": {str(w): v for w, v in windows.items()},
               "best_window": best, "best_window_over_fixed": windows[best] / fixed, "ar_over_fixed": ar / fixed,
               "prefill_share_fixed": p, "total_bound_best_window": total_ratio(max(windows[best], ar) / fixed, p)}
        if prefix is not None:
            packed = packed_oracle(sched, B, prefix)
            row.update(packed_oracle=packed, packed_oracle_over_fixed=packed["tokens_per_row_ms"] / fixed,
                       total_bound_packed_oracle=total_ratio(packed["tokens_per_row_ms"] / fixed, p))
        for mode in ("scheduled", "packed"):
            if mode in modes and "fixed" in modes:
                row[f"measured_{mode}_over_fixed"] = modes[mode]["decode_tokens_per_s"] / modes["fixed"]["decode_tokens_per_s"]
                row[f"measured_{mode}_over_fixed_decode_only"] = (modes[mode]["decode_only_tokens_per_s"]
                                                                  / modes["fixed"]["decode_only_tokens_per_s"])
        out[b] = row
    return {"mean_survival": survival.tolist(), "synthetic": bool(synthetic), "spread": spread, "batch": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a verify_concurrency.py JSON (.json / .json.gz)")
    ap.add_argument("--rows", type=int, default=20000, help="Monte Carlo rows of the synthetic acceptance")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    try:
        report = vc.read_json(a.result)
        res = bound(report, a.rows)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: {a.result}: not a verify_concurrency result with a cost curve ({e!r})") from None
    for b, r in res["batch"].items():
        line = (f"[bound] B={int(b):3d} AR/fixed {r['ar_over_fixed']:.3f} | best window w{r['best_window']} "
                f"{r['best_window_over_fixed']:.3f} (total <= {r['total_bound_best_window']:.3f})")
        if "packed_oracle_over_fixed" in r:
            line += (f" | per-row oracle {r['packed_oracle_over_fixed']:.3f} "
                     f"(total <= {r['total_bound_packed_oracle']:.3f})")
        if "measured_scheduled_over_fixed" in r:
            line += (f" | measured scheduled {r['measured_scheduled_over_fixed']:.3f} "
                     f"(decode-only {r['measured_scheduled_over_fixed_decode_only']:.3f})")
        print(line)
    name = Path(a.result).name.removesuffix(".gz").removesuffix(".json")
    path = Path(a.out_dir) / f"schedule-bound-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"source": str(a.result), "git_sha": report.get("git_sha"), "gpu": report.get("gpu"),
                                "command": "python benchmarks/schedule_bound.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                "monte_carlo_rows": a.rows, **res}, indent=1))
    print(f"[bound] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
