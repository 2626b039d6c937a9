"""Loss curves as one PNG (matplotlib is optional: without it nothing is drawn).

``python -m dspark_trt.train.plots RUN_DIR`` redraws ``RUN_DIR/loss_curves.png`` from
``RUN_DIR/train_summary.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _smooth(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot_histories(models: dict[str, dict], path: str | Path) -> Path | None:
    """models: name -> History.to_dict(); returns the PNG path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    drafts = {n: h for n, h in models.items() if h["eval"] and "tau_t1" in h["eval"][0]}
    ncols = len(models) + bool(drafts)
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 3.6), squeeze=False)
    if drafts:
        ax = axes[0][-1]
        for name, h in drafts.items():
            ax.plot([s / max(1, h["total_steps"]) for s in h["eval_steps"]],
                    [e["tau_t1"] for e in h["eval"]], "o-", ms=3, label=name)
        ax.set_title("held-out expected tau (T=1, teacher forced)")
        ax.set_xlabel("fraction of training")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax, (name, h) in zip(axes[0], models.items()):
        n = max(1, len(h["train_loss"]) // 50)
        ax.plot(h["steps"][:len(h["train_loss"])], _smooth(h["train_loss"], n), label="train loss")
        if h["eval"]:
            key = "ce" if "ce" in h["eval"][0] else next(iter(h["eval"][0]))
            ax.plot(h["eval_steps"], [e[key] for e in h["eval"]], "o-", ms=3,
                    label=f"held-out {key}")
            if "l1" in h["eval"][0] and name != "target":
                ax.plot(h["eval_steps"], [e["l1"] for e in h["eval"]], "s-", ms=3,
                        label="held-out L1(p_d, p_t)")
        if h.get("best_step") is not None and h["best_step"] >= 0:
            ax.axvline(h["best_step"], color="gray", ls="--", lw=1,
                       label=f"kept: step {h['best_step']}")
        ax.set_title(f"{name} ({h['total_steps']} steps, {h['seconds']:.0f} s)")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    summary = json.loads((run_dir / "train_summary.json").read_text())
    print(plot_histories(summary["models"], run_dir / "loss_curves.png") or "matplotlib missing")
