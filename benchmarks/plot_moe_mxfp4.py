"""Routed experts against tokens (``moe_mxfp4_bench.py`` JSONs): the share of the GPU's HBM peak each
kernel reaches (bytes of the chosen experts over cold-L2 time) per model, with #23's 70 % goal.
A variant is drawn from the first file that has it, so a later run's variants (e.g. a route that
was dropped) can join an earlier one's; ``--before`` adds an earlier run's default MXFP4 GEMV as a
series of its own. Reads ``.json`` or ``.json.gz``; writes a small PNG.

    python benchmarks/plot_moe_mxfp4.py benchmarks/results/moe-mxfp4-NVIDIA-H100-80GB-HBM3-2768239.json.gz \\
        benchmarks/results/moe-mxfp4-NVIDIA-H100-80GB-HBM3-aa1178a.json.gz [--before OLD.json.gz] --out moe-mxfp4.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plot_fp8_engine_linear import load, save_png  # noqa: E402

SERIES = {"bf16": "bf16 grouped", "bf16_gemv": "bf16 GEMV", "mxfp4_gemv_e4m3": "MXFP4 GEMV, e4m3 (default)",
          "mxfp4_gemv_e4m3_nopdl": "MXFP4 GEMV, e4m3, no PDL", "mxfp4_gemv_mma": "MXFP4 tensor-core GEMV (dropped)",
          "mxfp4_grouped_dot_scaled": "MXFP4 grouped, tl.dot_scaled"}
GOAL = 70.0


def curves(docs: list[dict], before: dict | None = None) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """model -> series label -> [(tokens, % of HBM)] ascending; each variant from the first file with it;
    ``before``: that run's default MXFP4 GEMV, labelled with its commit."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for d, series in [(d, SERIES) for d in docs] + ([(before, {"mxfp4_gemv": f"MXFP4 GEMV at {before['git_sha']}"})]
                                                    if before else []):
        for row in d["rows"]:
            for name, label in series.items():
                rec = row.get(name)
                if isinstance(rec, dict) and "pct" in rec:
                    out.setdefault(row["model"], {}).setdefault(label, {}).setdefault(row["M"], rec["pct"])
    return {m: {s: sorted(p.items()) for s, p in series.items()} for m, series in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--before", help="an earlier run: its default MXFP4 GEMV as a series of its own")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    docs = [load(p) for p in args.files]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = curves(docs, load(args.before) if args.before else None)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, (model, series) in zip(axes[0], models.items()):
        for label, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=4, label=label)
        ax.axhline(GOAL, color="k", ls=":", lw=1, label=f"#23 goal ({GOAL:.0f} %)")
        shape = docs[0]["shapes"].get(model, {})
        ax.set_title(f"V4-{model.capitalize()} experts (d={shape.get('d')}, h={shape.get('h')}, top-{shape.get('k')}), "
                     f"{docs[0]['gpu']} ({docs[0]['git_sha']})", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 100)
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"% of HBM peak ({docs[0]['peak_bytes_per_s'] / 1e12:.2f} TB/s), cold L2")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_png(fig, args.out)


if __name__ == "__main__":
    main()
