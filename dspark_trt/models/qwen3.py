"""Qwen3 decoder (the target): per-head q/k RMSNorm, GQA, neox RoPE, SwiGLU, untied head.

``forward`` processes T tokens per row at absolute positions, writes their K/V into the slot cache
in place, attends causally, and returns logits and the *taps*: the raw outputs of the configured
decoder layers (residual stream after the layer, before the final norm), concatenated.
Parameter names equal the HF checkpoint names (``model.layers.0.self_attn.q_proj.weight`` ...).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import plugins
from ..config import Qwen3Config
from .layers import RMSNorm, SwiGLU, apply_rope_neox, make_paged_kv_cache, rope_cos_sin


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qkv_proj = None                      # set by models.fuse.fuse_projections_

    def _rope_kv(self, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Raw projections [B, T, Hkv*D] -> roped, k-normed K and plain V, each [B, T, Hkv, D]."""
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.hkv, self.d))
        return apply_rope_neox(k, cos, sin), v.view(B, T, self.hkv, self.d)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, d] -> roped, k-normed K and plain V, each [B, T, Hkv, D] (no query)."""
        if self.qkv_proj is None:
            return self._rope_kv(self.k_proj(x), self.v_proj(x), cos, sin)
        k, v = F.linear(x, self.qkv_proj.rows_from(1)).split(self.qkv_proj.sizes[1:], -1)
        return self._rope_kv(k, v, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                block_table: Tensor, positions: Tensor, kv_limit: Tensor) -> Tensor:
        B, T, _ = x.shape
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x)
        q = apply_rope_neox(self.q_norm(q.view(B, T, self.h, self.d)), cos, sin)
        k, v = self._rope_kv(k, v, cos, sin)
        o = self.attend(q, k, v, k_cache, v_cache, block_table, positions, kv_limit)
        return self.o_proj(o.reshape(B, T, self.h * self.d))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               block_table: Tensor, positions: Tensor, kv_limit: Tensor) -> Tensor:
        """Write k / v [B, T, Hkv, D] into the paged caches, attend q [B, T, H, D] -> [B, T, H, D]
        (the two ``dspark`` ops; ``runtime.compiled`` keeps them out of torch.compile's graphs)."""
        plugins.kv_cache_write(k_cache, v_cache, k, v, block_table, positions)
        return plugins.block_attention(q, k_cache, v_cache, block_table, positions, kv_limit, self.d ** -0.5)


def local_kv_heads(layers: nn.ModuleList, cfg) -> int:
    """KV heads this module's attention holds: the config's, or this rank's share once
    ``parallel.tp`` has sharded the heads (a shape of the module, not a run setting)."""
    return layers[0].self_attn.hkv if len(layers) else cfg.num_key_value_heads


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, block_table, positions, kv_limit) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, block_table,
                               positions, kv_limit)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """The target network. ``tap_layer_ids`` are the layers whose raw outputs feed the draft."""

    packs_rows = True    # rows are independent: a row's tokens may run as rows of one token each
                         # sharing its block table (the packed verify, runtime/packed_verify.py)

    def __init__(self, cfg: Qwen3Config, tap_layer_ids: list[int] | tuple[int, ...] = ()):
        super().__init__()
        self.config = cfg
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device) -> dict:
        c = self.config
        return make_paged_kv_cache(c.num_hidden_layers, num_pages, page_size,
                                   local_kv_heads(self.model.layers, c), c.head_dim, dtype, device)

    def forward(self, tokens: Tensor, positions: Tensor, block_table: Tensor,
                cache: dict[str, list[Tensor]]) -> tuple[Tensor, Tensor]:
        """tokens, positions [B, T] (position < 0: padding); block_table [B, pages] ->
        logits [B, T, V], taps [B, T, len(tap_layer_ids) * d]."""
        x = self.model.embed_tokens(tokens.clamp(min=0))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache["k"][i], cache["v"][i], block_table, positions, positions)
            if i in self.tap_layer_ids:
                taps.append(x)
        logits = self.lm_head(self.model.norm(x))
        tap = torch.cat(taps, -1) if taps else x.new_zeros(*x.shape[:2], 0)
        return logits, tap
