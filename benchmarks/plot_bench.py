"""Plot a ``dspark-trt bench`` JSON: step latencies against batch size next to the HBM roofline of
the autoregressive step (and the compiled HF peer's step where it ran), the roofline efficiency of
each step per batch size (the JSON's ``sweep``), and decode throughput speculative vs
autoregressive (with the projection at the paper's tau). Writes ``<json stem>.png`` beside the JSON
(or ``--out``); ``dspark-trt bench`` writes it itself.

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


EFFICIENCIES = (("ar_roofline_efficiency", "AR step", "o-"),
                ("verify_roofline_efficiency", "verify step", "s-"),
                ("draft_roofline_efficiency", "draft step", "^-"),
                ("hf_compiled_roofline_efficiency", "HF compiled (decode step)", "x:"))


def sweep_columns(report: dict) -> dict[str, list]:
    """The ``sweep`` rows as columns (batch ascending; None where a row lacks a field)."""
    rows = sorted(report.get("sweep") or [], key=lambda r: r["batch_size"])
    keys = {k for r in rows for k in r}
    return {k: [r.get(k) for r in rows] for k in keys | {"batch_size"}}


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = series(report)
    sw = sweep_columns(report)
    tau = next(iter(report["batch"].values()))["projection_at_paper_tau"]["tau"]
    fig, (a, e, b) = plt.subplots(1, 3, figsize=(16, 4.2))
    for key, label, style in (("ar_ms", "AR step", "o-"), ("verify_ms", "verify step (N+1 tokens)", "s-"),
                              ("draft_ms", "draft step", "^-"), ("roofline_ms", "AR roofline (HBM)", "k--")):
        if all(v is not None for v in s[key]):
            a.plot(s["batch"], s[key], style, label=label)
    hf = [(b, v) for b, v in zip(sw["batch_size"], sw.get("hf_compiled_step_ms", [])) if v is not None]
    if hf:
        a.plot(*zip(*hf), "x:", label="HF compiled decode step")
    a.set(xscale="log", xlabel="batch size", ylabel="ms", title="step latency")
    a.set_xticks(s["batch"], [str(x) for x in s["batch"]])
    a.legend(fontsize=8)
    for key, label, style in EFFICIENCIES:
        pts = [(b, v) for b, v in zip(sw["batch_size"], sw.get(key, [])) if v is not None]
        if pts:
            e.plot(*zip(*pts), style, label=label)
    e.axhline(0.85, color="k", ls="--", lw=0.8, label="85 % goal")
    e.set(xscale="log", xlabel="batch size", ylabel="roofline / measured", title="HBM roofline efficiency",
          ylim=(0, 1.05))
    e.set_xticks(s["batch"], [str(x) for x in s["batch"]])
    e.legend(fontsize=8)
    b.plot(s["batch"], s["ar_tps"], "o-", label="autoregressive")
    b.plot(s["batch"], s["spec_tps"], "s-", label="speculative (measured tau)")
    b.plot(s["batch"], s["proj_tps"], "s:", label=f"speculative at tau {tau} (projection)")
    b.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s", title="throughput")
    b.set_xticks(s["batch"], [str(x) for x in s["batch"]])
    b.legend(fontsize=8)
    model = report.get("model", {})
    name = Path(model["engine"]).name + " engine" if model.get("engine") else model.get("preset") or "default pair"
    weights = ", random weights" if model.get("random_weights") else ""
    ep = report.get("eager_path") or {}
    how = "" if ep.get("engine", True) else (f", eager {'fused' if ep.get('fused_projections') else 'unfused'}"
                                             f"{', compiled ' + ep['compiled'] if ep.get('compiled') else ''}")
    for ax in (a, e, b):
        ax.minorticks_off()
    fig.suptitle(f"{name}{weights}{how} on {report['gpu']} ({report['git_sha']})", fontsize=9)
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
