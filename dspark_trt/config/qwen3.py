"""Qwen3 target and DSpark draft configs, read from and written to HF-style ``config.json``
dictionaries. Every check raises ``ConfigError`` naming the offending field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checks import ConfigError, _positive, _require


# what the published Qwen/Qwen3-*-FP8 checkpoints write (weights fp8 e4m3 + weight_scale_inv per
# 128x128 block; "dynamic": activation scales made at run time per token and 128 columns. Here the
# activations stay in the model dtype unless --quantization fp8-w8a8 quantises them that way)
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}


def read_quantization_config(q: dict | None) -> str | None:
    """config.json ``quantization_config`` -> None (absent) or "fp8"; anything else is refused."""
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config field 'quantization_config.quant_method': {method!r} is not supported "
                          "(fp8 block-scaled checkpoints only)")
    if list(q.get("weight_block_size") or []) != [128, 128]:
        raise ConfigError(f"config field 'quantization_config.weight_block_size': "
                          f"{q.get('weight_block_size')!r} is not [128, 128]")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config field 'quantization_config.fmt': {q.get('fmt')!r} is not e4m3")
    return "fp8"


@dataclass
class Qwen3Config:
    """Qwen3 decoder dimensions (target, and the backbone of its DSpark draft)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    quantization: str | None = None          # "fp8": attention / MLP projections in fp8 e4m3 with
                                             # 128x128 block scales (config.json quantization_config)
    arch: str = "qwen3"

    def validate(self) -> "Qwen3Config":
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_attention_heads} attention heads are not a multiple of "
                 f"{self.num_key_value_heads} KV heads")
        _require(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        _require(self.rope_theta > 0, "rope_theta", "must be positive")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        _require(self.quantization in (None, "fp8"), "quantization",
                 f"{self.quantization!r} is not supported (None or 'fp8')")
        return self

    # --- HF config.json ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        d = dict(d)
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 1e6))
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "intermediate_size"):
            if name not in d:
                raise ConfigError(f"config field '{name}': missing from config.json")
        eos = d.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"], rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), eos_token_id=eos,
            quantization=read_quantization_config(d.get("quantization_config")),
        ).validate()

    def to_hf(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16", "eos_token_id": self.eos_token_id,
            **({"quantization_config": dict(FP8_QUANTIZATION_CONFIG)} if self.quantization == "fp8" else {}),
        }


@dataclass
class DSparkConfig:
    """DSpark draft settings on top of a backbone config (Qwen3 dims for the Qwen3 drafters).

    ``markov_rank == 0`` gives a DFlash-style draft (no sequential head).
    """

    backbone: Qwen3Config
    num_hidden_layers: int = 5
    block_size: int = 7
    mask_token_id: int = 151669
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 9, 17, 25, 33])
    markov_rank: int = 256
    num_target_layers: int = 36
    enable_confidence_head: bool = False
    arch: str = "qwen3_dspark"

    def validate(self, target: Qwen3Config | None = None) -> "DSparkConfig":
        self.backbone.validate()
        _positive(self, "num_hidden_layers", "block_size", "num_target_layers")
        _require(isinstance(self.markov_rank, int) and self.markov_rank >= 0, "markov_rank",
                 f"must be a non-negative integer, got {self.markov_rank!r}")
        _require(0 <= self.mask_token_id < self.backbone.vocab_size, "mask_token_id",
                 f"{self.mask_token_id} is outside the vocabulary [0, {self.backbone.vocab_size})")
        ids = list(self.target_layer_ids)
        _require(len(ids) > 0, "target_layer_ids", "must name at least one layer")
        _require(all(b > a for a, b in zip(ids, ids[1:])), "target_layer_ids",
                 f"{ids} must be strictly increasing")
        _require(ids[0] >= 0, "target_layer_ids", f"{ids[0]} is negative")
        _require(ids[-1] < self.num_target_layers - 1, "target_layer_ids",
                 f"layer {ids[-1]} is not below the last target layer {self.num_target_layers - 1} "
                 "(the last layer's output is final-normed in HF hidden states, so it is not a tap)")
        if target is not None:
            _require(self.num_target_layers == target.num_hidden_layers, "num_target_layers",
                     f"{self.num_target_layers} != target num_hidden_layers {target.num_hidden_layers}")
            for n in ("hidden_size", "vocab_size"):
                _require(getattr(self.backbone, n) == getattr(target, n), n,
                         f"draft {getattr(self.backbone, n)} != target {getattr(target, n)}")
        return self

    @classmethod
    def from_hf(cls, d: dict) -> "DSparkConfig":
        backbone = dict(d)
        # The draft config.json is the target config with the draft's layer count.
        dflash = d.get("dflash_config") or {}
        ids = d.get("target_layer_ids", dflash.get("target_layer_ids"))
        mask = d.get("mask_token_id", dflash.get("mask_token_id"))
        if ids is None:
            raise ConfigError("config field 'target_layer_ids': missing from draft config.json")
        if mask is None:
            raise ConfigError("config field 'mask_token_id': missing from draft config.json")
        if "block_size" not in d:
            raise ConfigError("config field 'block_size': missing from draft config.json")
        num_target_layers = d.get("num_target_layers", max(ids) + 2)
        backbone["num_hidden_layers"] = num_target_layers   # backbone dims describe the target
        return cls(
            backbone=Qwen3Config.from_hf(backbone),
            num_hidden_layers=d["num_hidden_layers"], block_size=d["block_size"],
            mask_token_id=mask, target_layer_ids=list(ids),
            markov_rank=int(d.get("markov_rank", 0) or 0),
            num_target_layers=num_target_layers,
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
        )

    def to_hf(self) -> dict:
        d = self.backbone.to_hf()
        d.update({
            "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids), "markov_rank": self.markov_rank,
            "markov_head_type": "vanilla", "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.enable_confidence_head,
        })
        return d

    def layer_config(self) -> Qwen3Config:
        """Backbone dims with the draft's own layer count."""
        return dataclasses.replace(self.backbone, num_hidden_layers=self.num_hidden_layers)
