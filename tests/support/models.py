"""Tiny random model pairs for tests (float64 where decode paths must not near-tie)."""
from __future__ import annotations

import dataclasses

import torch

from dspark_trt.config import DSparkConfig, ModelPair, Qwen3Config


def tiny_pair(vocab: int = 64, hidden: int = 32, layers: int = 3, heads: int = 4, kv_heads: int = 2,
              draft_layers: int = 2, block: int = 4, rank: int = 8, taps=(0, 1)) -> ModelPair:
    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, intermediate_size=2 * hidden,
                         max_position_embeddings=1024)
    draft = DSparkConfig(backbone=dataclasses.replace(target), num_hidden_layers=draft_layers,
                         block_size=block, mask_token_id=vocab - 1, target_layer_ids=list(taps),
                         markov_rank=rank, num_target_layers=layers)
    return ModelPair("tiny-test", target, draft).validate()


def scale_weights_(module: torch.nn.Module, factor: float) -> None:
    """Sharpen a random model's logits (random init gives near-uniform distributions)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("lm_head.weight"):
                p.mul_(factor)
