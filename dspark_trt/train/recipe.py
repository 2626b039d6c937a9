"""Training recipes: model sizes and per-model schedules, by preset name."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import DSparkConfig, Qwen3Config
from .sources import DEFAULT_PACKAGES, SplitSpec
from .tokenizer import EOS_ID, MASK_ID


@dataclass
class Schedule:
    """How one model trains. ``steps=None``: as many steps as its share of the time budget allows
    (measured after a few steps); otherwise exactly ``steps``."""

    budget_share: float
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    steps: int | None = None
    num_anchors: int = 0          # drafts only: blocks per sequence
    eval_points: int = 20         # held-out evaluations over the run
    warmup_frac: float | None = None   # if set, warmup = round(warmup_frac * total steps)
    lr_floor: float = 0.1         # cosine decays to lr_floor * lr
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1     # on matrices only
    minutes: float | None = None  # stages: wall-clock cap of a budget-based (steps=None) schedule


def deepspec_draft_schedule(steps: int, batch_size: int, seq_len: int, num_anchors: int,
                            eval_points: int = 10) -> Schedule:
    """DeepSpec's draft optimiser: lr 6e-4, betas (0.9, 0.999), no weight decay, 4 % warmup,
    cosine to 0; a fixed step count (the same for every draft of a run)."""
    return Schedule(budget_share=0.0, batch_size=batch_size, seq_len=seq_len, lr=6e-4, warmup=0,
                    steps=steps, num_anchors=num_anchors, eval_points=eval_points, warmup_frac=0.04,
                    lr_floor=0.0, betas=(0.9, 0.999), weight_decay=0.0)


@dataclass
class DistillSpec:
    """Self-distilled draft data: prompts cut from the distill split, continued by the target.

    ``greedy_frac`` of the continuations are greedy, the rest sampled at ``temperature`` /
    ``top_p`` (DeepSpec: T 0.7, top-p 0.8, top-k 20; the runtime has no top-k, so top-p only).
    ``eval_prompts`` more prompts from the eval split give the held-out generated text.
    """

    num_prompts: int = 8192
    eval_prompts: int = 256
    prompt_min: int = 32
    prompt_max: int = 256
    new_tokens: int = 256
    greedy_frac: float = 0.25
    temperature: float = 0.7
    top_p: float = 0.8
    batch_size: int = 256
    seed: int = 1


@dataclass
class TrainRecipe:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tap_layer_ids: list[int]
    draft_layers: int
    block_size: int
    markov_rank: int
    ar_layers: int
    target: Schedule
    dspark: Schedule
    dflash: Schedule
    ar: Schedule
    minutes_budget: float = 6.0
    rope_theta: float = 10000.0
    train_file_every: int = 1     # keep every k-th training file (held-out files are all kept)
    eval_windows: int = 16
    dflash_objective: str = "ce"  # "ce": DeepSpec's DFlash baseline; "same": DSpark's CE+L1 mix
    seed: int = 0
    init_std: float = 0.02
    extra: dict = field(default_factory=dict)
    # staged pipeline (``stages.py``): corpus roots/splits, distillation, one schedule for drafts
    packages: tuple[str, ...] = ()
    split: SplitSpec = field(default_factory=SplitSpec)
    distill: DistillSpec = field(default_factory=DistillSpec)
    drafts: Schedule | None = None      # DSpark, DFlash and AR drafts: same steps, same batches
    confidence_head: bool = True        # DSpark: train DeepSpec's confidence head alongside
    target_eval_windows: int = 64

    def target_config(self) -> Qwen3Config:
        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
                           max_position_embeddings=4096, tie_word_embeddings=True,
                           eos_token_id=[EOS_ID]).validate()

    def draft_config(self, markov_rank: int) -> DSparkConfig:
        t = self.target_config()
        return DSparkConfig(backbone=dataclasses.replace(t), num_hidden_layers=self.draft_layers,
                            block_size=self.block_size, mask_token_id=MASK_ID,
                            target_layer_ids=list(self.tap_layer_ids), markov_rank=markov_rank,
                            num_target_layers=self.num_layers).validate(t)

    def ar_config(self) -> Qwen3Config:
        return dataclasses.replace(self.target_config(), num_hidden_layers=self.ar_layers)

    def validate(self) -> "TrainRecipe":
        if self.dflash_objective not in ("ce", "same"):
            raise ValueError(f"dflash_objective must be 'ce' or 'same', got {self.dflash_objective!r}")
        if self.minutes_budget <= 0:
            raise ValueError(f"minutes_budget must be positive, got {self.minutes_budget}")
        if self.drafts is not None:        # staged: one fixed-step schedule for every draft
            if not (self.drafts.steps and self.drafts.steps > 0 and self.drafts.num_anchors > 0):
                raise ValueError("drafts schedule needs a fixed step count and num_anchors > 0 "
                                 f"(got steps={self.drafts.steps}, num_anchors={self.drafts.num_anchors})")
        else:
            for name in ("dspark", "dflash"):
                s = getattr(self, name)
                if not 0 < s.num_anchors < s.seq_len:
                    raise ValueError(f"{name}.num_anchors {s.num_anchors} must be in (0, seq_len)")
        self.draft_config(self.markov_rank)
        return self


def _h200() -> TrainRecipe:
    """~6 M-parameter target (6 layers, d 256, vocab 4096, tied embeddings) + 2-layer drafts."""
    return TrainRecipe(
        name="v1-h200", vocab_size=4096, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=768, tap_layer_ids=[1, 3, 4], draft_layers=2, block_size=7,
        markov_rank=128, ar_layers=1,
        target=Schedule(budget_share=0.46, batch_size=64, seq_len=512, lr=2e-3, warmup=200),
        dspark=Schedule(budget_share=0.2, batch_size=32, seq_len=256, lr=1.5e-3, warmup=100,
                        num_anchors=64),
        dflash=Schedule(budget_share=0.2, batch_size=32, seq_len=256, lr=1.5e-3, warmup=100,
                        num_anchors=64),
        ar=Schedule(budget_share=0.14, batch_size=32, seq_len=256, lr=2e-3, warmup=100),
        minutes_budget=6.0)


def _smoke() -> TrainRecipe:
    """Seconds on a CPU: checks the pipeline end to end, learns little."""
    return TrainRecipe(
        name="v1-smoke", vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, tap_layer_ids=[0, 1], draft_layers=2, block_size=7,
        markov_rank=16, ar_layers=1,
        target=Schedule(budget_share=0.4, batch_size=8, seq_len=128, lr=3e-3, warmup=3, steps=20,
                        eval_points=2),
        dspark=Schedule(budget_share=0.2, batch_size=8, seq_len=64, lr=3e-3, warmup=3, steps=10,
                        num_anchors=8, eval_points=2),
        dflash=Schedule(budget_share=0.2, batch_size=8, seq_len=64, lr=3e-3, warmup=3, steps=10,
                        num_anchors=8, eval_points=2),
        ar=Schedule(budget_share=0.2, batch_size=8, seq_len=64, lr=3e-3, warmup=3, steps=10,
                    eval_points=2),
        minutes_budget=2.0, train_file_every=60, eval_windows=4)


def _staged_h200() -> TrainRecipe:
    """The default pair for ``dspark-trt train --stage``: a ~22 M-parameter target (6 layers,
    d 512, vocab 8192, tied embeddings; 44 MB in bf16) on stdlib + installed packages, and
    2-layer drafts (DSpark: Markov rank 64) on the target's own continuations.
    The target trains a fixed 1,400 steps (~4.9 epochs of its 9.4 M-token split on the H200's
    packages; ~70 s): a 7-minute run (8,325 steps) reached its best held-out loss at step 1,040
    and memorised after that (benchmarks/results/train-h200-target-7min-76887d6.log.gz)."""
    drafts = deepspec_draft_schedule(steps=2000, batch_size=16, seq_len=512, num_anchors=512)
    return TrainRecipe(
        name="h200", vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8,
        num_kv_heads=4, head_dim=64, intermediate_size=1408, tap_layer_ids=[1, 3, 4],
        draft_layers=2, block_size=7, markov_rank=64, ar_layers=1,
        target=Schedule(budget_share=0.0, batch_size=64, seq_len=512, lr=1.5e-3, warmup=200,
                        steps=1400, eval_points=40),
        dspark=drafts, dflash=drafts, ar=drafts, drafts=drafts, minutes_budget=15.0,
        packages=DEFAULT_PACKAGES, distill=DistillSpec(), eval_windows=32, target_eval_windows=64)


def _staged_cpu() -> TrainRecipe:
    """Minutes on a 2-core CPU (stdlib only): a ~1.3 M-parameter target and 1-layer drafts, to
    see the recipe learn (tau well above 1, DSpark vs DFlash) without a GPU."""
    drafts = deepspec_draft_schedule(steps=300, batch_size=8, seq_len=160, num_anchors=64,
                                     eval_points=3)
    drafts = dataclasses.replace(drafts, lr=1.5e-3)       # 300 steps: a higher peak than 6e-4
    return TrainRecipe(
        name="cpu", vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, intermediate_size=384, tap_layer_ids=[1, 2], draft_layers=1, block_size=7,
        markov_rank=32, ar_layers=1,
        target=Schedule(budget_share=0.0, batch_size=16, seq_len=256, lr=2e-3, warmup=50,
                        eval_points=12, minutes=3.0),
        dspark=drafts, dflash=drafts, ar=drafts, drafts=drafts, minutes_budget=10.0,
        distill=DistillSpec(num_prompts=512, eval_prompts=48, prompt_min=32, prompt_max=96,
                            new_tokens=64, batch_size=64),
        eval_windows=16, target_eval_windows=32)


def _staged_smoke() -> TrainRecipe:
    """Seconds per stage on a CPU: exercises every stage, learns little."""
    drafts = deepspec_draft_schedule(steps=4, batch_size=4, seq_len=48, num_anchors=16,
                                     eval_points=1)
    return TrainRecipe(
        name="smoke", vocab_size=320, hidden_size=32, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=16, intermediate_size=64, tap_layer_ids=[0, 1], draft_layers=1,
        block_size=7, markov_rank=8, ar_layers=1,
        target=Schedule(budget_share=0.0, batch_size=4, seq_len=48, lr=3e-3, warmup=2, steps=6,
                        eval_points=3),
        dspark=drafts, dflash=drafts, ar=drafts, drafts=drafts, minutes_budget=1.0,
        distill=DistillSpec(num_prompts=8, eval_prompts=4, prompt_min=8, prompt_max=16,
                            new_tokens=12, greedy_frac=0.5, batch_size=8),
        eval_windows=2, target_eval_windows=2,
        split=SplitSpec(eval_frac=0.3, distill_frac=0.3))


PRESETS = {"h200": _staged_h200, "smoke": _staged_smoke, "cpu": _staged_cpu,   # staged (#18)
           "v1-h200": _h200, "v1-smoke": _smoke}                # the one-shot ``train_all`` recipe


def get_recipe(name: str) -> TrainRecipe:
    if name not in PRESETS:
        raise ValueError(f"unknown training preset '{name}'; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
