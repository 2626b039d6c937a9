"""Where a decode step's kernel time goes, side by side for several ``profile_step.py`` JSONs:
stacked bars of kernel time per forward by kind (GEMMs, cuBLAS split-K reduces, attention, the
KV-cache write, inductor's fused norm / RoPE / activation kernels, the rest), the kernel count on
top, and the HBM roofline of the weights as a line. Reads ``.json`` or ``.json.gz``.

    python benchmarks/plot_profile.py benchmarks/results/profile-compiled-b1-{31b1ba3,ec8a0be}.json.gz \\
        --out benchmarks/results/profile-compiled-b1-31b1ba3-vs-ec8a0be.png
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

# (kind, substrings of the kernel name), first match wins; the order is the stacking order
KINDS = (("GEMM", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma")),
         ("split-K reduce", ("splitkreduce",)),
         ("attention", ("block_attention",)),
         ("KV-cache write", ("kv_cache_write",)),
         ("fused norm / RoPE / act. (inductor)", ("triton_",)),
         ("other", ("",)))
QWEN3_8B_TARGET_BYTES = 15_136_811_008       # bf16 weights a 1-token target forward reads


def kind_of(name: str) -> str:
    low = name.lower()
    return next(kind for kind, keys in KINDS if any(k in low for k in keys))


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def breakdown(profile: dict) -> dict[str, float]:
    """Kernel time per forward (us) by kind; the kernels outside the JSON's top list count as
    "other" (the top list covers nearly all of a step's time)."""
    out = {kind: 0.0 for kind, _ in KINDS}
    for row in profile["top"]:
        out[kind_of(row["name"])] += row["us_per_call"]
    out["other"] += max(0.0, profile["kernel_us_per_call"] - sum(out.values()))
    return out


def plot(reports: list[dict], labels: list[str], network: str, out: Path, hbm_tbps: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.6 + 1.4 * len(reports), 4.2))
    bottoms = [0.0] * len(reports)
    parts = [breakdown(r["profiles"][network]) for r in reports]
    for kind, _ in KINDS:
        vals = [p[kind] for p in parts]
        ax.bar(labels, vals, bottom=bottoms, label=kind, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, r in enumerate(reports):
        ax.text(i, bottoms[i], f"{r['profiles'][network]['kernels_per_call']:.0f} kernels",
                ha="center", va="bottom", fontsize=8)
    if network == "target_1":
        roof = QWEN3_8B_TARGET_BYTES / (hbm_tbps * 1e12) * 1e6
        ax.axhline(roof, color="k", ls="--", lw=1, label=f"HBM roofline of the weights ({roof:.0f} us)")
    ax.set_ylabel(f"kernel time per {network} call (us)")
    ax.set_title(f"{network}: kernel time by kind ({reports[0].get('gpu', '')})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"[plot-profile] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", help="profile_step.py JSONs, in bar order")
    ap.add_argument("--network", default="target_1", help="target_1, target_8, draft_block, ...")
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    reports = [load(p) for p in a.profiles]
    missing = [p for p, r in zip(a.profiles, reports) if a.network not in r.get("profiles", {})]
    if missing:
        raise SystemExit(f"error: no {a.network!r} profile in {missing}")
    labels = [f"{r.get('networks', '?')}\n{r.get('git_sha', '?')}" for r in reports]
    plot(reports, labels, a.network, Path(a.out), a.hbm_tbps)


if __name__ == "__main__":
    main()
