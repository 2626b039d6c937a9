"""Training recipes: model sizes and per-model schedules, by preset name."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import DSparkConfig, Qwen3Config
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
        for name in ("dspark", "dflash"):
            s = getattr(self, name)
            if not 0 < s.num_anchors < s.seq_len:
                raise ValueError(f"{name}.num_anchors {s.num_anchors} must be in (0, seq_len)")
        self.draft_config(self.markov_rank)
        return self


def _h200() -> TrainRecipe:
    """~6 M-parameter target (6 layers, d 256, vocab 4096, tied embeddings) + 2-layer drafts."""
    return TrainRecipe(
        name="h200", vocab_size=4096, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
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
        name="smoke", vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
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


PRESETS = {"h200": _h200, "smoke": _smoke}


def get_recipe(name: str) -> TrainRecipe:
    if name not in PRESETS:
        raise ValueError(f"unknown training preset '{name}'; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
