"""Time per call against token count for ``fp8_engine_linear_bench.py`` JSONs: one line per variant
(bf16, fp8 weight-only bucketed, fp8-w8a8, ...) of each file, and the HBM roofline of the bf16 and
the fp8 weights, log-scaled token axis. Reads ``.json`` or ``.json.gz``; writes a small palette PNG.

    python benchmarks/plot_fp8_engine_linear.py benchmarks/results/fp8-engine-linear-NVIDIA-H200-e484ee8.json.gz \\
        --out benchmarks/results/fp8-engine-linear-NVIDIA-H200-e484ee8.png
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

STYLE = {"bf16": ("tab:gray", "-"), "bucketed": ("tab:blue", "-"), "one_launch": ("tab:blue", ":"),
         "concrete": ("tab:cyan", ":"), "w8a8": ("tab:red", "-")}
LABEL = {"bf16": "bf16 (cuBLAS)", "bucketed": "fp8 weight-only", "one_launch": "fp8 weight-only, one launch",
         "concrete": "fp8 weight-only, eager", "w8a8": "fp8-w8a8"}


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def roofline_us(row: dict, variant: str, peak: float) -> float:
    return row[variant]["bytes"] / peak * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for path in args.files:
        d = load(path)
        rows, tag = d["rows"], f" ({d['git_sha']})" if len(args.files) > 1 else ""
        ms = [r["M"] for r in rows]
        for v in [k for k in rows[0] if isinstance(rows[0][k], dict) and "us" in rows[0][k]]:
            color, ls = STYLE.get(v, (None, "--"))
            ax.plot(ms, [r[v]["us"] for r in rows], ls, color=color, marker="o", ms=3, label=LABEL.get(v, v) + tag)
        for v, name in (("bf16", "bf16 bytes"), ("bucketed", "fp8 bytes")):
            if v in rows[0]:
                ax.plot(ms, [roofline_us(r, v, d["peak_bytes_per_s"]) for r in rows], ":", color="black",
                        lw=0.8, alpha=0.6 if v == "bf16" else 1.0)
                ax.annotate(f"roofline, {name}", (ms[-1], roofline_us(rows[-1], v, d["peak_bytes_per_s"])),
                            fontsize=7, ha="right", va="bottom")
    d = load(args.files[0])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens per call (batch x (N + 1))")
    ax.set_ylabel("us per call (CUDA-graph replay)")
    ax.set_title(f"{d['layers']} Qwen3-8B layers' projections, AOTI with dynamic tokens, {d['gpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_png(fig, args.out)


def save_png(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, in a 256-colour palette where PIL is installed (a few tens of KB)."""
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    try:
        from PIL import Image
        Image.open(out).convert("RGB").quantize(256).save(out, optimize=True)
    except ImportError:
        pass
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
