"""Summarise the bench JSONs of benchmarks/tp_gpu.sh into tp_scaling.json: step latencies per run
and the TP=1 / TP=2 ratios (> 1 means two GPUs are faster), once for eager steps and once for
CUDA-graph replay (the eager runs are host-bound at batch 1, so the graph ratio is the one that
shows the split of the GPU work).

    python benchmarks/tp_scaling.py DIR      (reads DIR/<tag>-bench-*.json, writes DIR/tp_scaling.json)
"""
from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

KEYS = ("verify_step_ms", "draft_step_ms", "ar_step_ms", "target_forward_1_ms")
TAGS = ("tp1-eager", "tp2-eager", "tp1-graphs", "tp2-graphs")


def load_runs(run_dir: Path) -> dict:
    runs = {}
    for tag in TAGS:
        files = sorted(glob.glob(str(run_dir / f"{tag}-bench-*.json")))
        if files:
            r = json.loads(Path(files[0]).read_text())
            runs[tag] = {"file": Path(files[0]).name, "parallel": r.get("parallel"),
                         "graphs_skipped": r.get("graphs_skipped"),
                         "batch": {b: {k: row.get(k) for k in KEYS}
                                   | {"spec_tokens_per_s": row["speculative"]["decode_tokens_per_s"]}
                                   for b, row in r["batch"].items()}}
    return runs


def ratios(one: dict | None, two: dict | None) -> dict:
    """{batch: {key_tp1_over_tp2: ratio}} for the batches both runs measured."""
    if not one or not two:
        return {}
    return {b: {f"{k}_tp1_over_tp2": one["batch"][b][k] / two["batch"][b][k] for k in KEYS
                if one["batch"][b].get(k) and two["batch"][b].get(k)}
            for b in one["batch"] if b in two["batch"]}


def main(run_dir: str) -> None:
    d = Path(run_dir)
    runs = load_runs(d)
    out = {"runs": runs,
           "eager_scaling_tp1_over_tp2": ratios(runs.get("tp1-eager"), runs.get("tp2-eager")),
           "graphs_scaling_tp1_over_tp2": ratios(runs.get("tp1-graphs"), runs.get("tp2-graphs"))}
    (d / "tp_scaling.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
