"""What the scheduled mode's decisions are on a measured cost curve (issue #25): per batch size,
expected tokens per row per ms (host overhead included) of AR, of the fixed round and of the best verify window under a
prefix-survival curve, ``VerifyScheduler.prefers_ar`` and Algorithm 1's admitted width for rows at
that curve's expected confidences. Reads a ``verify_concurrency.py`` JSON (its ``cost_curve``).

    python benchmarks/fallback_decision.py benchmarks/results/verify-concurrency-h200-qwen3-8b-synthetic-a8f3096.json \
        --survival benchmarks/results/confidence-calibration-h200-462ac15.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_trt.runtime.confidence import MODE_IDS, CostCurve, VerifyScheduler  # noqa: E402


def decisions(curve: CostCurve, survival: list[float], n: int) -> dict:
    s = np.asarray(survival[:n], dtype=np.float64)
    cond = s / np.concatenate([[1.0], s[:-1]])                       # conditional acceptance
    sched = VerifyScheduler(n, max(curve.rows) * (n + 1), "cpu", cost=curve)
    out = {}
    for B in curve.rows:
        opts = dict(sched.spec_options(B, s))
        best = max(opts, key=opts.get)
        logits = torch.logit(torch.tensor(cond)).float()[None].expand(B, -1).contiguous()
        adm = sched.admit(logits, torch.ones(B, dtype=torch.bool),
                          torch.full((B,), MODE_IDS["scheduled"]), torch.zeros(B))
        out[str(B)] = {"ar": 1.0 / (curve.step_ms("ar", B) + sched.round_overhead_ms), "fixed": opts[n], "best_window": best,
                       "best": opts[best], "prefers_ar": sched.prefers_ar(B, s),
                       "admitted_width": int(adm.max())}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="verify_concurrency.py JSON (cost_curve, model.num_spec_tokens)")
    p.add_argument("--survival", required=True, help="calibrate JSON (before.per_position[*].label_mean)")
    a = p.parse_args(argv)
    r = json.loads(Path(a.result).read_text())
    c = r["cost_curve"]
    curve = CostCurve(c["tokens"], c["latency_ms"], c.get("source", a.result), c["rows"], c["draft_ms"], c["ar_ms"])
    surv = [float(q["label_mean"]) for q in json.loads(Path(a.survival).read_text())["before"]["per_position"]]
    for B, d in decisions(curve, surv, r["model"]["num_spec_tokens"]).items():
        print(f"B={int(B):3d} tokens/row/ms: AR {d['ar']:.4f} fixed {d['fixed']:.4f} best w={d['best_window']} "
              f"{d['best']:.4f} -> {'AR' if d['prefers_ar'] else 'spec'}; admitted width {d['admitted_width']}")


if __name__ == "__main__":
    main()
