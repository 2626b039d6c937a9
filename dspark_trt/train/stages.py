"""``dspark-trt train --stage``: the training run as resumable stages over one output directory.

  target   corpus manifest (files + hashes + splits), tokenizer, target trained on the target
           split; the checkpoint of best held-out loss is kept -> target/, target curves
  distill  prompts from the distill split (and the eval split, for held-out text) continued by
           the target through the runtime -> distill/train.pt, distill/eval.pt
  drafts   DSpark (Markov head), DFlash (rank 0) and a 1-layer AR draft, each for the same fixed
           number of steps on the same batches of distilled data -> draft/, dflash/, ar_draft/
  eval     teacher-forced tau (T = 0 and T = 1) of the three drafts on the held-out generated
           text; runtime tau at the recipe's block size -> eval.json; summary + loss curves

Every stage reads only the directory (and the recorded corpus files), writes its outputs, then
marks itself done in ``stages.json``; a finished stage is skipped, a draft already saved is not
retrained. ``stages.json`` records the recipe: resuming with another recipe is refused.
Checkpoints are bf16 safetensors in shards of at most 16 MiB (``checkpoints.SHARD_LIMIT``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..atomic_write import write_json_atomic
from . import checkpoints, plots
from .batches import WindowSampler, encode_files, fixed_windows, token_stream
from .best import BestCheckpoint
from .confidence import ConfidenceHead, load_confidence
from .dense import causal_lm_forward, draft_block_logits
from .distill import DistillSampler, DistillSet, continue_prompts, cut_prompts
from .loop import run_training
from .modules import build_ar_draft, build_block_draft, build_target
from .objective import LossWeights, ar_draft_loss, block_loss, causal_lm_loss, sample_masked_anchors
from .pipeline import Run, target_lm_step
from .recipe import TrainRecipe
from .sources import MANIFEST, Manifest, default_roots, load_or_scan, read_texts
from .tokenizer import tokenizer_sha256, train_tokenizer

STAGES = ("target", "distill", "drafts", "eval")
STATE = "stages.json"
SUMMARY = "train_summary.json"
DRAFTS = {"dspark": "draft", "dflash": "dflash", "ar_draft": "ar_draft"}     # name -> directory


OUTPUTS = {"target": ["target/config.json", "tokenizer.json", MANIFEST],
           "distill": ["distill/train.pt", "distill/eval.pt"],
           "drafts": [f"{d}/config.json" for d in DRAFTS.values()],
           "eval": ["eval.json"]}
OUTPUTS.update({f"drafts.{n}": [f"{d}/config.json"] for n, d in DRAFTS.items()})


class StageError(RuntimeError):
    """A stage cannot run on this directory (missing inputs, other recipe)."""


class OutOfTime(Exception):
    """A stage stopped between units of work because this call's time budget ran out."""


# recipe fields a stage does not depend on (so they may still change before it runs)
DRAFT_FIELDS = {"distill", "drafts", "dspark", "dflash", "ar", "confidence_head", "eval_windows",
                "markov_rank", "draft_layers", "ar_layers", "block_size", "minutes_budget", "name"}
INDEPENDENT = {"target": DRAFT_FIELDS, "distill": DRAFT_FIELDS - {"distill"}}


def recipe_sha256(r: TrainRecipe, stage: str | None = None) -> str:
    """Hash of the recipe fields ``stage`` depends on (all fields for None / later stages)."""
    d = {k: v for k, v in dataclasses.asdict(r).items() if k not in INDEPENDENT.get(stage, ())}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


class RunDir:
    """The output directory and its stage state (``stages.json``). Each finished stage records
    the hash of the recipe fields it depends on; resuming with a recipe that changes one of them
    is refused (a draft's step count may change until the drafts train, say)."""

    def __init__(self, path: Path, recipe: TrainRecipe):
        self.path, self.r = Path(path), recipe
        self.path.mkdir(parents=True, exist_ok=True)
        self.state_path = self.path / STATE
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.state.setdefault("done", {})
        for key, info in self.state["done"].items():
            stage = key.split(".")[0]
            if info.get("recipe_sha256") not in (None, recipe_sha256(recipe, stage)):
                raise StageError(f"{self.path}: stage {key} was run with another recipe "
                                 f"('{self.state.get('recipe')}'; --seed, --draft-steps and "
                                 "--target-minutes count): use the same options, or a new "
                                 "--output directory")
        self.state["recipe"] = recipe.name

    def done(self, key: str) -> bool:
        """Marked done and its outputs are here (a directory carried without, say, the
        distilled data re-runs that stage)."""
        return key in self.state["done"] and all((self.path / f).exists()
                                                 for f in OUTPUTS.get(key, []))

    def mark(self, key: str, info: dict) -> None:
        self.state["done"][key] = info | {"recipe_sha256": recipe_sha256(self.r, key.split(".")[0])}
        self.save()

    def save(self) -> None:
        write_json_atomic(self.state_path, self.state, indent=1)

    def write_json(self, name: str, obj) -> None:
        write_json_atomic(self.path / name, obj, indent=1)

    def read_json(self, name: str):
        p = self.path / name
        if not p.exists():
            raise StageError(f"{p} is missing: run the stage that writes it first")
        return json.loads(p.read_text())


# ---- data helpers ----------------------------------------------------------------------------

def _tokenizer(rd: RunDir):
    from tokenizers import Tokenizer
    p = rd.path / "tokenizer.json"
    if not p.exists():
        raise StageError(f"{p} is missing: run --stage target first")
    return Tokenizer.from_file(str(p))


def _stream(rd: RunDir, man: Manifest, split: str, tok) -> torch.Tensor:
    """Token stream [S] int32 of a split (cached under cache/, which is never packed)."""
    cache = rd.path / "cache" / f"{split}-{man.sha256(split)[:16]}-{tokenizer_sha256(tok)[:16]}.pt"
    if cache.exists():
        return torch.load(cache, weights_only=True)
    stream = token_stream(encode_files(tok, read_texts(man, split)))
    cache.parent.mkdir(exist_ok=True)
    torch.save(stream, cache)
    return stream


def _manifest(rd: RunDir) -> Manifest:
    p = rd.path / MANIFEST
    if not p.exists():
        raise StageError(f"{p} is missing: run --stage target first")
    return Manifest.from_json(p.read_text())


# ---- stage: target ---------------------------------------------------------------------------

def stage_target(rd: RunDir, run: Run, roots, deadline: float) -> dict:
    r, s = rd.r, rd.r.target
    man = load_or_scan(rd.path, roots if roots is not None else default_roots(r.packages), r.split)
    run.log(f"[train] corpus: {man.counts()} (roots {sorted(man.roots)}); "
            f"{len(man.skipped)} files skipped")
    texts = read_texts(man, "target")
    tok = train_tokenizer(texts, r.vocab_size)
    (rd.path / "tokenizer.json").write_text(tok.to_str())
    train = _stream(rd, man, "target", tok)
    held = _stream(rd, man, "eval", tok)
    run.log(f"[train] {train.numel()} target-split / {held.numel()} eval-split tokens")
    target = build_target(r, run.device, r.seed)
    data = WindowSampler(train, s.seq_len, s.batch_size, r.seed + 1, run.device)
    held_w = fixed_windows(held, s.seq_len, r.target_eval_windows).to(run.device)
    step = target_lm_step(run, target, data)

    @torch.no_grad()
    def evaluate():
        ce = 0.0
        for i in range(0, held_w.shape[0], s.batch_size):
            w = held_w[i:i + s.batch_size]
            with run.amp():
                ce += causal_lm_loss(causal_lm_forward(target, w)[0], w).item() * w.shape[0]
        return {"ce": ce / held_w.shape[0]}

    best = BestCheckpoint(target, "ce")
    budget = min(60.0 * (s.minutes or 1e9), max(1.0, deadline - time.time()))
    hist = run_training("target", list(target.parameters()), step, evaluate, s, budget,
                        run.device, run.log, on_eval=best.update)
    best_step = best.restore()
    run.log(f"[train] target: best held-out ce {best.best_value:.4f} at step {best_step} of "
            f"{hist.total_steps}")
    checkpoints.save_target(rd.path / "target", target, tok.to_str(), checkpoints.SHARD_BYTES)
    out = hist.to_dict() | {"best_step": best_step, "best_heldout_ce": best.best_value,
                            "tokens": {"target": train.numel(), "eval": held.numel()},
                            "tokens_seen": hist.total_steps * s.batch_size * s.seq_len}
    rd.write_json("history_target.json", out)
    plots.plot_histories({"target": out}, rd.path / "target_loss.png")
    return {"best_step": best_step, "steps": hist.total_steps, "manifest_sha256": man.sha256()}


# ---- stage: distill --------------------------------------------------------------------------

def _load_target(rd: RunDir, run: Run):
    return checkpoints.load_target(rd.path / "target", rd.r.tap_layer_ids, torch.float32, run.device)


def stage_distill(rd: RunDir, run: Run, deadline: float) -> dict:
    d = rd.r.distill
    man, tok = _manifest(rd), _tokenizer(rd)
    target = _load_target(rd, run)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    target = target.to(dtype)
    out_dir = rd.path / "distill"
    out_dir.mkdir(exist_ok=True)
    info = {}
    for name, split, n, seed in (("train", "distill", d.num_prompts, d.seed),
                                 ("eval", "eval", d.eval_prompts, d.seed + 1)):
        prompts = cut_prompts(_stream(rd, man, split, tok), n, d.prompt_min, d.prompt_max, seed)
        t0 = time.perf_counter()
        ds = continue_prompts(target, prompts, d, seed, run.device, dtype, run.log)
        ds.save(out_dir / f"{name}.pt")
        info[name] = ds.stats() | {"seconds": time.perf_counter() - t0}
    info["sampling"] = {"greedy_frac": d.greedy_frac, "temperature": d.temperature,
                        "top_p": d.top_p, "top_k": None,
                        "note": "the runtime has no top-k: DeepSpec's top-k 20 is not applied"}
    return info


# ---- stage: drafts ---------------------------------------------------------------------------

def _draft_model(rd: RunDir, name: str, target):
    if name == "ar_draft":
        return build_ar_draft(rd.r, target, rd.r.seed + 30)
    rank = rd.r.markov_rank if name == "dspark" else 0
    return build_block_draft(rd.r, target, rank, rd.r.seed + (10 if name == "dspark" else 20))


def _weights(name: str) -> LossWeights:
    """DSpark and the AR draft: the CE/L1 mix; DFlash: DeepSpec's baseline (CE only)."""
    return LossWeights(ce=1.0, l1=0.0) if name == "dflash" else LossWeights()


def draft_losses(rd: RunDir, run: Run, name: str, model, target, tokens, label_mask,
                 anchor_gen: torch.Generator, num_anchors: int, confidence=None) -> dict:
    """One batch: tokens, label_mask [B, L] -> the draft's loss dict (``confidence``: a
    ``ConfidenceHead`` trained with the DSpark draft)."""
    with torch.no_grad(), run.amp():
        t_logits, taps = causal_lm_forward(target, tokens, target.tap_layer_ids)
    w = _weights(name)
    if name == "ar_draft":
        with run.amp():
            logits, _ = causal_lm_forward(model, tokens)
        return ar_draft_loss(logits, tokens, t_logits, w, rd.r.block_size, label_mask)
    anchors, ok = sample_masked_anchors(label_mask, num_anchors, anchor_gen)
    with run.amp():
        U, h = draft_block_logits(model, taps, tokens, anchors, return_hidden=True)
    return block_loss(model, U, tokens, anchors, t_logits, w, label_mask, ok, confidence, h)


def teacher_forced(rd: RunDir, run: Run, name: str, model, target, data: DistillSet,
                   batch: int, num_anchors: int, confidence=None) -> dict:
    """Held-out metrics over all of ``data`` (fixed anchors), weighted by blocks per batch."""
    gen = torch.Generator().manual_seed(rd.r.seed + 99)
    acc: dict[str, float] = {}
    total = 0.0
    with torch.no_grad():
        for i in range(0, data.tokens.shape[0], batch):
            tokens = data.tokens[i:i + batch].long().to(run.device)
            mask = data.label_mask[i:i + batch].to(run.device)
            n = float(mask[:, 1:].sum())
            if n == 0:
                continue
            out = draft_losses(rd, run, name, model, target, tokens, mask, gen, num_anchors,
                               confidence)
            for k, v in out.items():
                if k != "loss":
                    acc[k] = acc.get(k, 0.0) + float(v) * n
            total += n
    return {k: v / max(total, 1.0) for k, v in acc.items()}


def stage_drafts(rd: RunDir, run: Run, deadline: float) -> dict:
    r, s = rd.r, rd.r.drafts
    train = DistillSet.load(rd.path / "distill" / "train.pt")
    held = DistillSet.load(rd.path / "distill" / "eval.pt")
    k = r.eval_windows                   # in-training evaluation: the first k held-out sequences
    held = DistillSet(held.tokens[:k], held.label_mask[:k], held.prompt_len[:k], held.greedy[:k])
    target = _load_target(rd, run)
    info = {}
    last_s = 0.0
    for name, sub in DRAFTS.items():
        key = f"drafts.{name}"
        if rd.done(key):
            run.log(f"[train] {name}: done already ({rd.path / sub}), skipped")
            info[name] = rd.state["done"][key]
            continue
        if time.time() + 1.15 * last_s >= deadline:
            raise OutOfTime(f"{name} would not finish in this call's budget (the last draft took "
                            f"{last_s:.0f} s)")
        model = _draft_model(rd, name, target)
        conf = None
        if name == "dspark" and r.confidence_head:
            torch.manual_seed(r.seed + 11)
            conf = ConfidenceHead(r.hidden_size, r.markov_rank).to(run.device)
        data = DistillSampler(train, s.batch_size, r.seed + 1, run.device)     # same batches
        gen = torch.Generator().manual_seed(r.seed + 2)                         # same anchors
        model.train()

        def step(model=model, data=data, gen=gen, name=name, conf=conf):
            tokens, mask = data.next()
            return draft_losses(rd, run, name, model, target, tokens, mask, gen, s.num_anchors,
                                conf)["loss"]

        def evaluate(model=model, name=name, conf=conf):
            model.eval()
            out = teacher_forced(rd, run, name, model, target, held, s.batch_size, s.num_anchors,
                                 conf)
            model.train()
            return out

        params = list(model.parameters()) + (list(conf.parameters()) if conf else [])
        hist = run_training(name, params, step, evaluate, s, 1e9, run.device, run.log)
        model.requires_grad_(False).eval()
        save = checkpoints.save_ar_draft if name == "ar_draft" else checkpoints.save_draft
        save(rd.path / sub, model, checkpoints.SHARD_BYTES)
        if conf is not None:
            conf.save(rd.path / sub)
        rd.write_json(f"history_{name}.json", hist.to_dict())
        info[name] = {"steps": hist.total_steps, "seconds": hist.seconds,
                      "final_eval": hist.eval[-1] if hist.eval else {}}
        last_s = hist.seconds
        rd.mark(key, info[name])
    steps = {n: v["steps"] for n, v in info.items()}
    if len(set(steps.values())) != 1:
        raise StageError(f"drafts trained for different step counts: {steps}")
    return info


# ---- stage: eval -----------------------------------------------------------------------------

def _runtime_tau(rd: RunDir, run: Run, sub: str, prompts, temperature: float) -> dict:
    """Speculative decoding with the runtime (target + draft ``sub``) -> tau, its 95 % CI over
    prompts, acceptance per position, and whether greedy output equals the target's."""
    from ..runtime.llm import LLM
    from ..runtime.sampling_params import SamplingParams
    d = rd.r.distill
    llm = LLM.from_checkpoints(rd.path / "target", rd.path / sub, device=run.device,
                               max_batch_size=len(prompts),
                               max_seq_len=max(len(p) for p in prompts) + d.new_tokens + 1)
    sps = [SamplingParams(temperature=temperature, max_new_tokens=d.new_tokens, seed=i,
                          ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, sps)
    taus = torch.tensor([o.stats.tau for o in outs], dtype=torch.float64)
    merged = outs[0].stats
    for o in outs[1:]:
        merged = merged.merge(o.stats)
    res = merged.to_dict() | {
        "ci95": 1.96 * float(taus.std() / len(taus) ** 0.5) if len(taus) > 1 else 0.0}
    if temperature == 0:
        ref = llm.generate(prompts, sps, speculative=False)
        res["greedy_equals_target"] = sum(a.output_ids == b.output_ids for a, b in zip(outs, ref))
    return res


def stage_eval(rd: RunDir, run: Run, deadline: float) -> dict:
    r = rd.r
    held = DistillSet.load(rd.path / "distill" / "eval.pt")
    target = _load_target(rd, run)
    tf = {}
    for name, sub in DRAFTS.items():
        if name == "ar_draft":
            model = checkpoints.load_ar_draft(rd.path / sub, torch.float32, run.device)
        else:
            from ..checkpoints.loaders import load_pair
            _, _, model = load_pair(rd.path / "target", rd.path / sub, torch.float32, run.device)
        conf = load_confidence(rd.path / sub, r, run.device) if name == "dspark" else None
        tf[name] = teacher_forced(rd, run, name, model, target, held, r.drafts.batch_size, 10**9,
                                  conf)
        run.log(f"[train] eval {name}: teacher-forced {tf[name]}")
    prompts = [held.tokens[i, :int(held.prompt_len[i])].tolist()
               for i in range(min(held.tokens.shape[0], 64))]
    runtime = {f"{name}_T{t:g}": _runtime_tau(rd, run, DRAFTS[name], prompts, t)
               for name in ("dspark", "dflash") for t in (0.0, 1.0)}
    for k, v in runtime.items():
        run.log(f"[train] eval runtime {k}: tau {v['tau']:.3f} +- {v['ci95']:.3f}")
    result = {"teacher_forced": tf, "runtime_block": r.block_size, "runtime": runtime,
              "prompts": len(prompts)}
    rd.write_json("eval.json", result)
    return {"tau_t0": {n: v["tau_t0"] for n, v in tf.items()},
            "runtime_tau": {k: v["tau"] for k, v in runtime.items()}}


# ---- driver ----------------------------------------------------------------------------------

def _summary(rd: RunDir) -> dict:
    models = {}
    for name in ("target",) + tuple(DRAFTS):
        p = rd.path / f"history_{name}.json"
        if p.exists():
            models[name] = json.loads(p.read_text())
    man = rd.path / MANIFEST
    summary = {"recipe": dataclasses.asdict(rd.r), "stages": rd.state, "models": models,
               "corpus": {k: v for k, v in json.loads(man.read_text()).items() if k != "files"}
               if man.exists() else None}
    rd.write_json(SUMMARY, summary)
    if models:
        plots.plot_histories(models, rd.path / "loss_curves.png")
    return summary


def run_stages(recipe: TrainRecipe, output: str | Path, stages: list[str], device="cpu",
               autocast: bool = True, roots: dict | None = None, minutes: float | None = None,
               log: Callable[[str], None] = print) -> dict:
    """Run ``stages`` (in STAGES order; "all" = every stage) on ``output``, skipping finished
    ones. ``minutes``: a wall-clock budget; a stage that cannot start before it runs out is left
    for the next call (the target stage also caps its training to the time left)."""
    stages = list(STAGES) if "all" in stages else [s for s in STAGES if s in stages]
    rd = RunDir(Path(output), recipe.validate())
    run = Run(recipe, device, autocast, log)
    deadline = time.time() + 60.0 * (minutes if minutes is not None else 1e6)
    funcs = {"target": lambda: stage_target(rd, run, roots, deadline),
             "distill": lambda: stage_distill(rd, run, deadline),
             "drafts": lambda: stage_drafts(rd, run, deadline),
             "eval": lambda: stage_eval(rd, run, deadline)}
    for name in stages:
        if rd.done(name):
            log(f"[train] stage {name}: done already, skipped")
            continue
        if time.time() >= deadline:
            log(f"[train] stage {name}: no time left in this call's budget; run again to resume")
            break
        t0 = time.time()
        log(f"[train] stage {name}: start")
        try:
            info = funcs[name]()
        except OutOfTime as e:
            log(f"[train] stage {name}: stopped, {e}; run again to resume")
            break
        info["seconds"] = time.time() - t0
        rd.mark(name, info)
        log(f"[train] stage {name}: done in {info['seconds']:.0f} s")
    return _summary(rd)
