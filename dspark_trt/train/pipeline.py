"""The whole training run: data -> tokenizer -> target -> DSpark, DFlash and AR drafts -> files.

Output directory:
  target/  draft/ (DSpark)  dflash/  ar_draft/   HF checkpoints (bf16 safetensors)
  train_summary.json   corpus manifest, hashes, recipe, per-model loss logs and timings
  loss_curves.png      training and held-out losses (when matplotlib is installed)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import torch

from . import checkpoints, plots
from .batches import WindowSampler, encode_files, fixed_windows, token_stream
from .corpus import HELDOUT, read_stdlib
from .dense import causal_lm_forward, draft_block_logits
from .loop import History, run_training
from .modules import build_ar_draft, build_block_draft, build_target
from .objective import (LossWeights, ar_draft_loss, block_loss, causal_lm_loss, sample_anchors)
from .recipe import Schedule, TrainRecipe
from .tokenizer import tokenizer_sha256, train_tokenizer

SUMMARY = "train_summary.json"


class Run:
    """Shared state of one training run (device, precision, data)."""

    def __init__(self, recipe: TrainRecipe, device, autocast: bool, log: Callable[[str], None]):
        self.r, self.device, self.log = recipe, torch.device(device), log
        self.autocast = autocast and self.device.type == "cuda"
        self.train_stream = self.heldout_stream = None

    def amp(self):
        if self.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sampler(self, s: Schedule, seed: int) -> WindowSampler:
        return WindowSampler(self.train_stream, s.seq_len, s.batch_size, seed, self.device)

    def heldout(self, s: Schedule) -> torch.Tensor:
        return fixed_windows(self.heldout_stream, s.seq_len, self.r.eval_windows).to(self.device)


# ---- per-model steps -------------------------------------------------------------------------

def target_lm_step(run: Run, target, data: WindowSampler) -> Callable[[], torch.Tensor]:
    """One next-token loss of the target on a fresh batch of ``data`` (``run_training``'s step)."""
    def step():
        tokens = data.next()
        with run.amp():
            logits, _ = causal_lm_forward(target, tokens)
        return causal_lm_loss(logits, tokens)
    return step


def train_target(run: Run, budget_s: float):
    r, s = run.r, run.r.target
    target = build_target(r, run.device, r.seed)
    data, held = run.sampler(s, r.seed + 1), run.heldout(s)
    step = target_lm_step(run, target, data)

    @torch.no_grad()
    def evaluate():
        with run.amp():
            logits, _ = causal_lm_forward(target, held)
        return {"ce": causal_lm_loss(logits, held).item()}

    hist = run_training("target", list(target.parameters()), step, evaluate, s, budget_s,
                        run.device, run.log)
    return target.requires_grad_(False).eval(), hist


def _target_features(run: Run, target, tokens):
    with torch.no_grad(), run.amp():
        return causal_lm_forward(target, tokens, target.tap_layer_ids)     # logits, taps


def train_block_draft(run: Run, target, name: str, markov_rank: int, weights: LossWeights,
                      s: Schedule, budget_s: float, seed: int):
    """DSpark (markov_rank > 0) or DFlash (0) draft on the frozen target's taps."""
    draft = build_block_draft(run.r, target, markov_rank, seed)
    data, held = run.sampler(s, seed + 1), run.heldout(s)
    gen = torch.Generator().manual_seed(seed + 2)
    held_anchors = sample_anchors(held.shape[0], held.shape[1], s.num_anchors,
                                  torch.Generator().manual_seed(seed + 3), run.device)

    def loss_on(tokens, anchors, w):
        t_logits, taps = _target_features(run, target, tokens)
        with run.amp():
            U = draft_block_logits(draft, taps, tokens, anchors)
        return block_loss(draft, U, tokens, anchors, t_logits, w)

    def step():
        tokens = data.next()
        anchors = sample_anchors(tokens.shape[0], tokens.shape[1], s.num_anchors, gen, run.device)
        return loss_on(tokens, anchors, weights)["loss"]

    @torch.no_grad()
    def evaluate():
        return {k: v.item() for k, v in loss_on(held, held_anchors, weights).items() if k != "loss"}

    draft.train()
    hist = run_training(name, list(draft.parameters()), step, evaluate, s, budget_s, run.device,
                        run.log)
    return draft.requires_grad_(False).eval(), hist


def train_ar_draft(run: Run, target, weights: LossWeights, budget_s: float, seed: int):
    s = run.r.ar
    ar = build_ar_draft(run.r, target, seed)
    data, held = run.sampler(s, seed + 1), run.heldout(s)

    def loss_on(tokens):
        t_logits, _ = _target_features(run, target, tokens)
        with run.amp():
            logits, _ = causal_lm_forward(ar, tokens)
        return ar_draft_loss(logits, tokens, t_logits, weights, run.r.block_size)

    @torch.no_grad()
    def evaluate():
        return {k: v.item() for k, v in loss_on(held).items() if k != "loss"}

    hist = run_training("ar_draft", list(ar.parameters()), lambda: loss_on(data.next())["loss"],
                        evaluate, s, budget_s, run.device, run.log)
    return ar.requires_grad_(False).eval(), hist


# ---- the run -----------------------------------------------------------------------------------

def prepare_data(run: Run, stdlib_root=None):
    """Read and split the stdlib, train the tokenizer, build the token streams -> (info, tokenizer)."""
    r = run.r
    t0 = time.perf_counter()
    train_files, held_files, manifest = read_stdlib(stdlib_root, HELDOUT, r.train_file_every)
    run.log(f"[train] stdlib {manifest.stdlib_dir} (Python {manifest.python_version}): "
            f"{manifest.train_files} train / {manifest.heldout_files} held-out files, "
            f"files sha256 {manifest.files_sha256[:16]}")
    tok = train_tokenizer((f.text for f in train_files), r.vocab_size)
    run.train_stream = token_stream(encode_files(tok, [f.text for f in train_files]))
    run.heldout_stream = token_stream(encode_files(tok, [f.text for f in held_files]))
    info = {"corpus": dataclasses.asdict(manifest), "heldout_modules": list(HELDOUT),
            "tokenizer_sha256": tokenizer_sha256(tok), "vocab_size": tok.get_vocab_size(),
            "train_tokens": run.train_stream.numel(), "heldout_tokens": run.heldout_stream.numel(),
            "seconds": time.perf_counter() - t0}
    run.log(f"[train] tokenizer {info['vocab_size']} entries (sha256 {info['tokenizer_sha256'][:16]}); "
            f"{info['train_tokens']} train / {info['heldout_tokens']} held-out tokens "
            f"({info['seconds']:.0f} s)")
    return info, tok


def train_all(recipe: TrainRecipe, output: str | Path, device="cpu", autocast: bool = True,
              stdlib_root=None, log: Callable[[str], None] = print) -> dict:
    """Train everything for ``recipe`` and write the output directory; returns the summary."""
    r = recipe.validate()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(r, device, autocast, log)
    t_start = time.perf_counter()
    budget = 60.0 * r.minutes_budget
    data_info, tok = prepare_data(run, stdlib_root)

    def share(s: Schedule) -> float:       # time left after data prep, split by budget shares
        return max(1.0, (budget - data_info["seconds"]) * s.budget_share)

    hists: dict[str, History] = {}
    target, hists["target"] = train_target(run, share(r.target))
    checkpoints.save_target(out / "target", target, tok.to_str())
    dspark_w = LossWeights()
    dflash_w = LossWeights(ce=1.0, l1=0.0) if r.dflash_objective == "ce" else LossWeights()
    draft, hists["dspark"] = train_block_draft(run, target, "dspark", r.markov_rank, dspark_w,
                                               r.dspark, share(r.dspark), r.seed + 10)
    checkpoints.save_draft(out / "draft", draft)
    dflash, hists["dflash"] = train_block_draft(run, target, "dflash", 0, dflash_w, r.dflash,
                                                share(r.dflash), r.seed + 20)
    checkpoints.save_draft(out / "dflash", dflash)
    ar, hists["ar_draft"] = train_ar_draft(run, target, dspark_w, share(r.ar), r.seed + 30)
    checkpoints.save_ar_draft(out / "ar_draft", ar)

    summary = {
        "recipe": dataclasses.asdict(r), "device": str(run.device),
        "device_name": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "bf16_autocast": run.autocast, "data": data_info,
        "objectives": {"dspark": dataclasses.asdict(dspark_w), "dflash": dataclasses.asdict(dflash_w),
                       "ar_draft": dataclasses.asdict(dspark_w), "target": "next-token CE"},
        "models": {k: h.to_dict() for k, h in hists.items()},
        "total_seconds": time.perf_counter() - t_start,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    png = plots.plot_histories(summary["models"], out / "loss_curves.png")
    log(f"[train] done in {summary['total_seconds']:.0f} s -> {out}"
        + ("" if png else " (no loss plot: matplotlib is not installed)"))
    return summary
