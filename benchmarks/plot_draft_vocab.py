"""The draft vocabulary's trade (``--draft-vocab``): left, the draft step against the number of
tokens in the draft's vocabulary at batch 1 and 16 with its HBM roofline (``decode_paths.py`` JSONs
of ``eager_chain`` / ``eager_chain_vocab``); right, tau against the set's size at each temperature
with its 95 % interval over prompts (a ``draft_vocab_acceptance.py`` JSON). Reads ``.json`` or
``.json.gz``; writes a small palette PNG.

    python benchmarks/plot_draft_vocab.py --paths benchmarks/results/decode-paths-draftvocab*-8f437d5.json.gz \\
        --acceptance benchmarks/results/draft-vocab-acceptance-cpu-353220b-dirty.json --out draft-vocab.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plot_fp8_engine_linear import load, save_png  # noqa: E402


def draft_steps(docs: list[dict]) -> dict[int, dict[int, dict]]:
    """batch -> tokens in the draft's vocabulary -> that step's row (the full vocabulary from the
    ``eager_chain`` path, a set from ``eager_chain_vocab``; the first file giving a point wins)."""
    out: dict[int, dict[int, dict]] = {}
    for d in docs:
        for name, path in d["paths"].items():
            if name not in ("eager_chain", "eager_chain_vocab") or "batch" not in path:
                continue
            size = d["shapes"]["draft_vocab_size"] if name.endswith("_vocab") else d["vocab_size"]
            for B, row in path["batch"].items():
                out.setdefault(int(B), {}).setdefault(size, row)
    return out


def taus(doc: dict) -> dict[str, list[tuple[int, float, float]]]:
    """temperature -> [(set size, tau, its 95 % half-width)] ascending by size."""
    out: dict[str, list] = {}
    for size, row in doc["sizes"].items():
        for t, stats in row.items():
            if t.startswith("T="):
                out.setdefault(t, []).append((int(size), stats["tau"], stats["tau_ci95"]))
    return {t: sorted(v) for t, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True, help="decode_paths.py JSONs")
    ap.add_argument("--vocab-size", type=int, default=151936, help="the full vocabulary (Qwen3-8B's)")
    ap.add_argument("--acceptance", help="a draft_vocab_acceptance.py JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    docs = [dict(load(p), vocab_size=args.vocab_size) for p in args.paths]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if args.acceptance else 1, figsize=(11 if args.acceptance else 6, 4.2),
                             squeeze=False)
    ax = axes[0][0]
    for B, points in sorted(draft_steps(docs).items()):
        sizes = sorted(points)
        line, = ax.plot(sizes, [points[s]["draft_step_ms"] for s in sizes], "o-", ms=4, label=f"batch {B}")
        ax.plot(sizes, [points[s]["draft_roofline_ms"] for s in sizes], ":", color=line.get_color(), lw=1,
                label=f"batch {B}, HBM roofline")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens in the draft's vocabulary")
    ax.set_ylabel("draft step (ms, CUDA-graph replay)")
    ax.set_title(f"Qwen3-8B dims, draft block of 7, {docs[0]['gpu']} ({docs[0]['git_sha']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if args.acceptance:
        acc = load(args.acceptance)
        ax = axes[0][1]
        for t, rows in taus(acc).items():
            ax.errorbar([r[0] for r in rows], [r[1] for r in rows], yerr=[r[2] for r in rows], fmt="o-", ms=4,
                        capsize=3, label=t)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the draft's vocabulary")
        ax.set_ylabel("tau (tokens per round, bonus included)")
        ax.set_title(f"{acc['model']} (V = {acc['vocab_size']}), {acc['device']} ({acc['git_sha']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, args.out)


if __name__ == "__main__":
    main()
