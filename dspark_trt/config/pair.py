"""``ModelPair``: a target config and its draft config (what a preset or a checkpoint pair describes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError


@dataclass
class ModelPair:
    """A target and its draft: what a preset or a pair of checkpoints describes."""

    name: str
    target: Any
    draft: Any

    def validate(self) -> "ModelPair":
        self.target.validate()
        self.draft.validate(self.target)
        return self

    def check_limits(self, max_batch_size: int | None, max_seq_len: int | None) -> None:
        """A batch of >= 1 sequence of 1 .. the target's context (max_position_embeddings)
        tokens; ``ConfigError`` otherwise (None: not checked)."""
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len is None:
            return
        context = getattr(self.target, "max_position_embeddings", None)
        if max_seq_len < 1:
            raise ConfigError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if context is not None and max_seq_len > context:
            raise ConfigError(f"max_seq_len={max_seq_len} exceeds the model's context of {context} "
                              "tokens (max_position_embeddings)")
