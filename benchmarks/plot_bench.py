"""Plot a ``dspark-trt bench`` JSON: step latencies against batch size next to the HBM roofline of
the autoregressive step, and decode throughput speculative vs autoregressive (with the projection
at the paper's tau). Writes ``<json stem>.png`` beside the JSON (or ``--out``).

    python benchmarks/plot_bench.py benchmarks/results/bench-NVIDIA-H200-engine-topk-b91427e.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(report: dict) -> dict[str, list]:
    """Per-batch columns, batch sizes ascending."""
    rows = sorted(((int(b), r) for b, r in report["batch"].items()), key=lambda t: t[0])
    col = lambda f: [f(r) for _, r in rows]  # noqa: E731
    return {"batch": [b for b, _ in rows],
            "ar_ms": col(lambda r: r["ar_step_ms"]), "verify_ms": col(lambda r: r["verify_step_ms"]),
            "draft_ms": col(lambda r: r["draft_step_ms"]), "roofline_ms": col(lambda r: r.get("ar_roofline_ms")),
            "spec_tps": col(lambda r: r["speculative"]["decode_tokens_per_s"]),
            "ar_tps": col(lambda r: r["autoregressive"]["decode_tokens_per_s"]),
            "proj_tps": col(lambda r: r["projection_at_paper_tau"]["spec_tokens_per_s"])}


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = series(report)
    tau = next(iter(report["batch"].values()))["projection_at_paper_tau"]["tau"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("ar_ms", "AR step", "o-"), ("verify_ms", "verify step (N+1 tokens)", "s-"),
                              ("draft_ms", "draft step", "^-"), ("roofline_ms", "AR roofline (HBM)", "k--")):
        if all(v is not None for v in s[key]):
            a.plot(s["batch"], s[key], style, label=label)
    a.set(xscale="log", xlabel="batch size", ylabel="ms", title="step latency")
    a.set_xticks(s["batch"], [str(x) for x in s["batch"]])
    a.legend(fontsize=8)
    b.plot(s["batch"], s["ar_tps"], "o-", label="autoregressive")
    b.plot(s["batch"], s["spec_tps"], "s-", label="speculative (measured tau)")
    b.plot(s["batch"], s["proj_tps"], "s:", label=f"speculative at tau {tau} (projection)")
    b.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s", title="throughput")
    b.set_xticks(s["batch"], [str(x) for x in s["batch"]])
    b.legend(fontsize=8)
    model = report.get("model", {})
    name = Path(model["engine"]).name + " engine" if model.get("engine") else model.get("preset") or "default pair"
    weights = ", random weights" if model.get("random_weights") else ""
    fig.suptitle(f"{name}{weights} on {report['gpu']} ({report['git_sha']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--out")
    a = ap.parse_args()
    src = Path(a.bench_json)
    print(plot(json.loads(src.read_text()), Path(a.out) if a.out else src.with_suffix(".png")))


if __name__ == "__main__":
    main()
