"""Presets by name: a fresh, validated ``ModelPair`` per call (``get_preset``, ``register_preset``)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .checks import ConfigError
from .pair import ModelPair
from .qwen3 import DSparkConfig, Qwen3Config
from .v4 import DeepSeekV4Config, DSparkV4Config, YarnScaling


def _qwen3_8b() -> ModelPair:
    target = Qwen3Config(eos_token_id=[151645, 151643])
    draft = DSparkConfig(backbone=dataclasses.replace(target), num_hidden_layers=5, block_size=7,
                         mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                         markov_rank=256, num_target_layers=36, enable_confidence_head=True)
    return ModelPair("qwen3-8b-dspark-block7", target, draft)


def _qwen3_8b_fp8() -> ModelPair:
    """Qwen/Qwen3-8B-FP8 (projections fp8 e4m3 with 128x128 block scales; embeddings, norms and
    lm_head in the model dtype) with the bf16 DSpark draft of ``qwen3-8b-dspark-block7``."""
    pair = _qwen3_8b()
    pair.target.quantization = "fp8"
    return ModelPair("qwen3-8b-fp8-dspark-block7", pair.target, pair.draft)


def _qwen3_tiny() -> ModelPair:
    target = Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=4096, eos_token_id=[])
    draft = DSparkConfig(backbone=dataclasses.replace(target), num_hidden_layers=2, block_size=4,
                         mask_token_id=511, target_layer_ids=[0, 2], markov_rank=16,
                         num_target_layers=4)
    return ModelPair("qwen3-tiny-dspark", target, draft)


def _pair(name: str, target: DeepSeekV4Config, stages: int, taps: list[int], rank: int,
          block: int = 5, mask: int = 128799) -> ModelPair:
    target.compress_ratios = list(target.compress_ratios[:target.num_hidden_layers]) + [0] * stages
    draft = DSparkV4Config(backbone=dataclasses.replace(target), num_stages=stages,
                           block_size=block, mask_token_id=mask, target_layer_ids=taps,
                           markov_rank=rank)
    return ModelPair(name, target, draft)


def _v4_flash() -> ModelPair:
    return _pair("deepseek-v4-flash-dspark", DeepSeekV4Config(), 3, [40, 41, 42], 256)


def _v4_pro() -> ModelPair:
    t = DeepSeekV4Config(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                         q_lora_rank=1536, o_lora_rank=1024, o_groups=16, index_topk=1024,
                         n_routed_experts=384, moe_intermediate_size=3072,
                         routed_scaling_factor=2.5,
                         compress_ratios=[128, 128] + [4, 128] * 29 + [4])
    return _pair("deepseek-v4-pro-dspark", t, 3, [58, 59, 60], 512)


def _v4_tiny() -> ModelPair:
    """Every V4 layer kind at CPU size: SWA-only, CSA (ratio 4 + indexer), HCA (ratio 16), hash
    and score-routed MoE; window 16 so compression boundaries fall within a few hundred tokens."""
    t = DeepSeekV4Config(vocab_size=512, hidden_size=64, num_hidden_layers=5,
                         num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
                         o_lora_rank=16, o_groups=2, sliding_window=16,
                         compress_ratios=[0, 4, 16, 4, 16], index_n_heads=2, index_head_dim=16,
                         index_topk=4, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, num_hash_layers=2, routed_scaling_factor=1.5,
                         rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=256),
                         max_position_embeddings=4096, eos_token_id=[])
    return _pair("deepseek-v4-tiny-dspark", t, 3, [1, 2, 3], 16, block=5, mask=500)


PRESETS: dict[str, Any] = {
    "qwen3-8b-dspark-block7": _qwen3_8b,
    "qwen3-8b-fp8-dspark-block7": _qwen3_8b_fp8,
    "qwen3-tiny-dspark": _qwen3_tiny,
    "deepseek-v4-flash-dspark": _v4_flash,
    "deepseek-v4-pro-dspark": _v4_pro,
    "deepseek-v4-tiny-dspark": _v4_tiny,
}


def register_preset(name: str, factory) -> None:
    PRESETS[name] = factory


def get_preset(name: str) -> ModelPair:
    """Return a fresh, validated ``ModelPair`` for a preset name."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]().validate()

