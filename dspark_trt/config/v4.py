"""DeepSeek-V4 target and DSpark-V4 draft configs (algorithm doc §8.1, §9.2).

One HF ``config.json`` describes both: the V4 fields plus ``dspark_*`` fields and ``n_mtp_layers``
(the draft stages, whose entries trail ``compress_ratios``). Checks raise ``ConfigError`` naming
the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checks import ConfigError, _positive, _require

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass
class YarnScaling:
    """YaRN frequency interpolation of the compressed layers' RoPE (no mscale)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class DeepSeekV4Config:
    """DeepSeek-V4 target dimensions. ``compress_ratios[i]``: 0 SWA-only, 4 CSA (indexer), else HCA."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512                 # the single MQA latent (K = V)
    qk_rope_head_dim: int = 64          # RoPE on the last 64 dims
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4])
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    expert_dtype: str = "fp4"           # routed experts' storage format in the checkpoint
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    tie_word_embeddings: bool = False
    arch: str = "deepseek_v4"

    def validate(self) -> "DeepSeekV4Config":
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                  "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
                  "hc_sinkhorn_iters", "max_position_embeddings")
        _require(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim,
                 "qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even and <= head_dim")
        _require(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim",
                 f"{self.index_head_dim} is smaller than the RoPE part {self.qk_rope_head_dim}")
        _require(self.num_attention_heads % self.o_groups == 0, "o_groups",
                 f"{self.num_attention_heads} heads are not a multiple of {self.o_groups} groups")
        _require(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        _require(0 <= self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
                 f"{self.num_hash_layers} is outside [0, num_hidden_layers]")
        _require(self.scoring_func in SCORING_FUNCS, "scoring_func",
                 f"'{self.scoring_func}' is not one of {SCORING_FUNCS}")
        _require(self.expert_dtype in ("fp4", "fp8", "bf16"), "expert_dtype",
                 f"'{self.expert_dtype}' is not fp4, fp8 or bf16")
        _require(len(self.compress_ratios) >= self.num_hidden_layers, "compress_ratios",
                 f"{len(self.compress_ratios)} entries for {self.num_hidden_layers} layers")
        for i, r in enumerate(self.compress_ratios):
            _require(isinstance(r, int) and r >= 0 and (r == 0 or r > 1), "compress_ratios",
                     f"entry {i} = {r!r} must be 0 (SWA-only) or an integer ratio > 1")
        _require(self.rms_norm_eps > 0 and self.hc_eps >= 0, "rms_norm_eps", "must be positive")
        return self

    def layer_ratio(self, i: int) -> int:
        return self.compress_ratios[i]

    @classmethod
    def from_hf(cls, d: dict) -> "DeepSeekV4Config":
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "compress_ratios", "q_lora_rank", "o_lora_rank"):
            if name not in d:
                raise ConfigError(f"config field '{name}': missing from config.json")
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls)
              if f.name in d and f.name not in ("rope_scaling", "arch", "eos_token_id")}
        rs = d.get("rope_scaling")
        if rs:
            kw["rope_scaling"] = YarnScaling(
                factor=float(rs.get("factor", 1.0)),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 0)),
                beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)))
        else:
            kw["rope_scaling"] = None
        if "expert_dtype" not in d:
            kw["expert_dtype"] = "fp4" if "quantization_config" in d else "bf16"
        eos = d.get("eos_token_id", [])
        kw["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos or [])
        kw["compress_ratios"] = [int(r or 0) for r in d["compress_ratios"]]
        return cls(**kw).validate()

    def to_hf(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_scaling", "arch")}
        d["compress_ratios"] = list(self.compress_ratios)
        d["rope_scaling"] = (None if self.rope_scaling is None else
                             {"type": "yarn", **dataclasses.asdict(self.rope_scaling)})
        d.update({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                  "num_key_value_heads": 1, "topk_method": "noaux_tc", "hidden_act": "silu",
                  "torch_dtype": "bfloat16"})
        return d


@dataclass
class DSparkV4Config:
    """DSpark draft on a V4 target: ``num_stages`` SWA-only V4 blocks (algorithm doc §9)."""

    backbone: DeepSeekV4Config
    num_stages: int = 3                 # n_mtp_layers
    block_size: int = 5                 # dspark_block_size (trained N)
    mask_token_id: int = 128799         # dspark_noise_token_id
    target_layer_ids: list[int] = field(default_factory=lambda: [40, 41, 42])
    markov_rank: int = 256
    arch: str = "deepseek_v4_dspark"

    @property
    def num_target_layers(self) -> int:
        return self.backbone.num_hidden_layers

    def stage_ratio(self, s: int) -> int:
        i = self.backbone.num_hidden_layers + s
        r = self.backbone.compress_ratios
        return r[i] if i < len(r) else 0

    def validate(self, target: DeepSeekV4Config | None = None) -> "DSparkV4Config":
        self.backbone.validate()
        _positive(self, "num_stages", "block_size")
        _require(isinstance(self.markov_rank, int) and self.markov_rank >= 0, "markov_rank",
                 f"must be a non-negative integer, got {self.markov_rank!r}")
        _require(0 <= self.mask_token_id < self.backbone.vocab_size, "dspark_noise_token_id",
                 f"{self.mask_token_id} is outside the vocabulary [0, {self.backbone.vocab_size})")
        ids = list(self.target_layer_ids)
        _require(len(ids) > 0 and ids[0] >= 0, "dspark_target_layer_ids", f"{ids} is invalid")
        _require(all(b > a for a, b in zip(ids, ids[1:])), "dspark_target_layer_ids",
                 f"{ids} must be strictly increasing")
        _require(ids[-1] < self.backbone.num_hidden_layers, "dspark_target_layer_ids",
                 f"layer {ids[-1]} >= num_hidden_layers {self.backbone.num_hidden_layers}")
        for s in range(self.num_stages):
            _require(self.stage_ratio(s) == 0, "compress_ratios",
                     f"draft stage {s} has ratio {self.stage_ratio(s)}; DSpark stages are SWA-only (0)")
        if target is not None:
            for n in ("hidden_size", "vocab_size", "num_hidden_layers"):
                _require(getattr(self.backbone, n) == getattr(target, n), n,
                         f"draft {getattr(self.backbone, n)} != target {getattr(target, n)}")
        return self

    @classmethod
    def from_hf(cls, d: dict) -> "DSparkV4Config":
        for name in ("dspark_block_size", "dspark_target_layer_ids"):
            if name not in d:
                raise ConfigError(f"config field '{name}': missing from config.json "
                                  "(not a DSpark checkpoint)")
        # n_mtp_layers is the stage count; the HF num_nextn_predict_layers (1) is not (doc §8.1).
        stages = d.get("n_mtp_layers") or 3
        return cls(backbone=DeepSeekV4Config.from_hf(d), num_stages=int(stages),
                   block_size=int(d["dspark_block_size"]),
                   mask_token_id=int(d.get("dspark_noise_token_id", 128799)),
                   target_layer_ids=list(d["dspark_target_layer_ids"]),
                   markov_rank=int(d.get("dspark_markov_rank", 0) or 0))

    def to_hf(self) -> dict:
        d = self.backbone.to_hf()
        d.update({"n_mtp_layers": self.num_stages, "dspark_block_size": self.block_size,
                  "dspark_noise_token_id": self.mask_token_id,
                  "dspark_target_layer_ids": list(self.target_layer_ids),
                  "dspark_markov_rank": self.markov_rank})
        return d
