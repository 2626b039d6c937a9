"""The scheduled mode's decisions and what any schedule could gain on a measured cost curve (issue
#25). Per batch size, expected committed tokens per row per ms of a round (draft, verify, host
overhead) for AR, the fixed round, the best trimmed window, and an oracle of the packed verify
(``VerifyScheduler.packed_gain``: the paper's Algorithm 1 per row on each row's exact conditional
acceptances, priced by the token curve measured on rectangles: a bound, the packed verify
measured costlier), each over the fixed
round; the measured steady-load ratios of the same JSON beside them. Prefill time is not in a
round, so a steady load's ratios sit closer to 1 by its prefill share.

The survival of the rows is the one ``verify_concurrency.py --synthetic`` replays: one logistic
offset per row (``--spread``, from the result's options by default), so a row's positions are
correlated, and per-position logits (``replay_logits``) that keep the batch survival
``E[prod_k q_k]`` the calibrate JSON's curve (before session 39 its conditional acceptances, which
gave the batch a heavier tail than the curve).

    python benchmarks/fallback_decision.py benchmarks/results/verify-concurrency-h200-qwen3-8b-synthetic-steady-0ab0aab.json.gz \\
        --survival benchmarks/results/confidence-calibration-h200-462ac15.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime.cost_curve import CostCurve  # noqa: E402
from dspark_trt.runtime.verify_scheduler import VerifyScheduler  # noqa: E402
from verify_concurrency import replay_logits, survival_curve, synthetic_rows  # noqa: E402


def packed_oracle(sched: VerifyScheduler, rows: int, logits, spread, rng, rounds=200) -> float:
    """Mean ``VerifyScheduler.packed_gain`` (Algorithm 1 per row on each row's exact conditional
    acceptances, the packed verify priced by the token curve) over ``rounds`` synthetic rounds."""
    return float(np.mean([sched.packed_gain(synthetic_rows(rng, rows, logits, spread)) for _ in range(rounds)]))


def bounds(result: dict, survival: list[float], spread: float, seed: int = 0) -> dict:
    c = result["cost_curve"]
    n = result["model"]["num_spec_tokens"]
    curve = CostCurve.from_json(c, c.get("source", "result"))    # every measured step, host times included
    sched = VerifyScheduler(n, max(curve.rows) * (n + 1), "cpu", cost=curve)
    logits = replay_logits(survival, n, spread)
    rng = np.random.default_rng(seed)
    true = np.cumprod(synthetic_rows(rng, 200_000, logits, spread), axis=1).mean(0)   # [N] batch survival
    out = {"survival": true.round(4).tolist(), "spread": spread, "batch": {}}
    for B in curve.rows:
        opts = dict(sched.spec_options(B, true))
        fixed, best = opts[n], max(opts, key=opts.get)
        ar = 1.0 / sched.priced_ms("ar", B)
        row = {"fixed": fixed, "ar_over_fixed": ar / fixed, "best_window": best,
               "window_over_fixed": opts[best] / fixed,
               "packed_oracle_over_fixed": packed_oracle(sched, B, logits, spread, rng),
               "prefers_ar": sched.prefers_ar(B, true)}
        measured = result.get("batch", {}).get(str(B), {})
        base = measured.get("fixed", {}).get("decode_tokens_per_s")
        for mode in ("scheduled", "packed", "autoregressive"):
            if base and mode in measured:
                row[f"measured_{mode}_over_fixed"] = measured[mode]["decode_tokens_per_s"] / base
        out["batch"][str(B)] = row
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="verify_concurrency.py JSON (cost_curve, model.num_spec_tokens)")
    p.add_argument("--survival", required=True, help="calibrate JSON (before.per_position[*].label_mean)")
    p.add_argument("--spread", type=float, default=None, help="per-row logistic spread (default: the result's)")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    r = json.loads((gzip.open if a.result.endswith(".gz") else open)(a.result, "rt").read())
    spread = a.spread if a.spread is not None else float(r.get("options", {}).get("spread") or 1.0)
    b = bounds(r, survival_curve(a.survival), spread)
    print(f"batch survival (spread {spread}): {b['survival']}")
    for B, d in b["batch"].items():
        m = " ".join(f"{k.removeprefix('measured_').removesuffix('_over_fixed')} {v:.2f}"
                     for k, v in d.items() if k.startswith("measured_"))
        print(f"B={int(B):3d} over fixed: AR {d['ar_over_fixed']:.2f}, best window w={d['best_window']} "
              f"{d['window_over_fixed']:.2f}, packed oracle {d['packed_oracle_over_fixed']:.2f}"
              + (f" | measured {m}" if m else ""))
    if a.out:
        b.update(result=a.result, survival_file=a.survival, git_sha=provenance.git_sha(),
                 command="python benchmarks/fallback_decision.py " + " ".join(sys.argv[1:] if argv is None else argv))
        Path(a.out).write_text(json.dumps(b, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
