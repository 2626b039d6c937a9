"""Qwen3 decoder (the target): per-head q/k RMSNorm, GQA, neox RoPE, SwiGLU, untied head.

``forward`` processes T tokens per row at absolute positions, writes their K/V into the slot cache
in place, attends causally, and returns logits and the *taps*: the raw outputs of the configured
decoder layers (residual stream after the layer, before the final norm), concatenated.
Parameter names equal the HF checkpoint names (``model.layers.0.self_attn.q_proj.weight`` ...).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import plugins
from ..plugins.block_attention import SlotGroups, grouped_block_attention
from ..config import Qwen3Config
from .layers import RMSNorm, SwiGLU, apply_rope_neox, make_paged_kv_cache, rope_cos_sin


class Qwen3Attention(nn.Module):
    row_kernels = False     # queries_and_cache / context_cache through qk_rope_cache (``use_row_kernels_``)

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
        k, v = self.qkv_proj.parts_from(x, 1)
        return self._rope_kv(k, v, cos, sin)

    def _rope_cache_rows(self, rows: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                         block_table: Tensor, positions: Tensor, q_heads: int) -> Tensor:
        """Projection rows [B, T, (q_heads + 2*Hkv)*D] through one ``qk_rope_cache`` launch: q/k norms,
        RoPE, K/V into the paged caches at ``positions`` [B, T]; returns the roped queries
        [B*T, q_heads, D] (none with ``q_heads`` = 0: the k norm stands in for the q norm)."""
        from ..plugins.kernels.qk_rope_cache import qk_rope_cache
        n = rows.shape[0] * rows.shape[1]
        q_norm = self.q_norm if q_heads else self.k_norm
        return qk_rope_cache(rows.view(n, -1), q_norm.weight, self.k_norm.weight, cos.reshape(n, self.d),
                             sin.reshape(n, self.d), k_cache, v_cache, block_table, positions, q_heads, q_norm.eps)

    def queries_and_cache(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                          block_table: Tensor, positions: Tensor) -> Tensor:
        """x [B, T, d] (normed) -> roped, q-normed queries [B, T, H, D]; writes the rows' K/V."""
        B, T, _ = x.shape
        if self.row_kernels:            # norms, RoPE and the cache write in one launch
            q = self._rope_cache_rows(self.qkv_proj.rows(x), cos, sin, k_cache, v_cache, block_table, positions,
                                      self.h)
            return q.view(B, T, self.h, self.d)
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x)
        q = apply_rope_neox(self.q_norm(q.view(B, T, self.h, self.d)), cos, sin)
        k, v = self._rope_kv(k, v, cos, sin)
        self.write_cache(k_cache, v_cache, k, v, block_table, positions)
        return q

    def context_cache(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                      block_table: Tensor, positions: Tensor) -> None:
        """x [B, T, d] (the draft's normed context rows) -> their K/V written into the paged caches
        at ``positions`` [B, T] (negative: nothing), no query. With the row kernels one GEMM of
        the k/v rows and one ``qk_rope_cache`` launch (no query heads), instead of the k norm's
        nine elementwise kernels, RoPE's six and the write."""
        if self.row_kernels:
            self._rope_cache_rows(self.qkv_proj.rows_from(x, 1), cos, sin, k_cache, v_cache, block_table, positions, 0)
            return
        k, v = self.kv(x, cos, sin)
        self.write_cache(k_cache, v_cache, k, v, block_table, positions)

    def output(self, o: Tensor) -> Tensor:
        """Attention output [B, T, H, D] -> o_proj [B, T, d]."""
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.h * self.d))

    def write_cache(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                    positions: Tensor) -> None:
        """k / v [B, T, Hkv, D] into the paged caches (``dspark::kv_cache_write``; ``runtime.compiled``
        swaps in its torch form, which inductor fuses into the k-norm / RoPE kernel)."""
        plugins.kv_cache_write(k_cache, v_cache, k, v, block_table, positions)

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                  positions: Tensor, kv_limit: Tensor, groups: SlotGroups | None = None) -> Tensor:
        """q [B, T, H, D] against the paged caches -> [B, T, H, D] (``dspark::block_attention``).
        ``groups``: q's rows are the packed verify's slots (T = 1), attended grouped by their batch
        rows (``grouped_block_attention``: each row's cache read once)."""
        if groups is not None:
            return grouped_block_attention(q, k_cache, v_cache, *groups, self.d ** -0.5)
        return plugins.block_attention(q, k_cache, v_cache, block_table, positions, kv_limit, self.d ** -0.5)


def local_kv_heads(layers: nn.ModuleList, cfg) -> int:
    """KV heads this module's attention holds: the config's, or this rank's share once
    ``parallel.tp`` has sharded the heads (a shape of the module, not a run setting)."""
    return layers[0].self_attn.hkv if len(layers) else cfg.num_key_value_heads


class Qwen3DecoderLayer(nn.Module):
    row_kernels = False     # residual add + RMSNorm in one launch (``use_row_kernels_``)

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, block_table, positions, kv_limit) -> Tensor:
        x, mlp = self.deferred(x, None, cos, sin, k_cache, v_cache, block_table, positions, kv_limit)
        return x + mlp

    def deferred(self, x: Tensor, pending: Tensor | None, cos, sin, k_cache, v_cache, block_table,
                 positions, kv_limit, groups: SlotGroups | None = None) -> tuple[Tensor, Tensor]:
        """The layer with the residual add of its MLP output left to the caller: the residual
        stream is ``x + pending`` on entry (None: x) and ``x' + mlp`` on exit, returned as
        (x', mlp). Chained through ``run_layers``, each layer adds the previous one's MLP output in
        the kernel of its input norm. Two phases around the attention, which ``runtime.compiled``
        compiles as two graphs (the attention runs between them). ``groups``: see
        ``Qwen3Attention.attention``."""
        x, q = self.attention_input(x, pending, cos, sin, k_cache, v_cache, block_table, positions)
        o = self.self_attn.attention(q, k_cache, v_cache, block_table, positions, kv_limit, groups)
        return self.attention_output(x, o)

    def attention_input(self, x: Tensor, pending: Tensor | None, cos, sin, k_cache, v_cache, block_table,
                        positions) -> tuple[Tensor, Tensor]:
        """-> (residual stream x + pending [B, T, d], queries [B, T, H, D]); writes the layer's K/V."""
        h, x = self._add_norm(self.input_layernorm, x, pending)
        return x, self.self_attn.queries_and_cache(h, cos, sin, k_cache, v_cache, block_table, positions)

    def attention_output(self, x: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
        """Residual x [B, T, d], attention output o [B, T, H, D] -> (x + o_proj(o), MLP output)."""
        h, x = self._add_norm(self.post_attention_layernorm, x, self.self_attn.output(o))
        return x, self.mlp(h)

    def _add_norm(self, norm: RMSNorm, x: Tensor, r: Tensor | None) -> tuple[Tensor, Tensor]:
        return add_norm(norm, x, r, self.row_kernels)


def add_norm(norm: RMSNorm, x: Tensor, r: Tensor | None, row_kernels: bool) -> tuple[Tensor, Tensor]:
    """(norm(x + r), x + r); r None: (norm(x), x). ``row_kernels``: in one launch (``add_rmsnorm``)."""
    if row_kernels:
        from ..plugins.kernels.norm_act import add_rmsnorm
        return add_rmsnorm(x, r, norm.weight, norm.eps)
    if r is not None:
        x = x + r
    return norm(x), x


def run_layers(layers, x: Tensor, cos: Tensor, sin: Tensor, cache: dict, block_table: Tensor,
               positions: Tensor, kv_limit: Tensor, tap_layer_ids=(),
               groups: SlotGroups | None = None) -> tuple[Tensor, list[Tensor]]:
    """Qwen3 decoder layers over x [B, T, d] -> (residual stream after the last layer, the raw
    outputs of ``tap_layer_ids``). Each layer's MLP output is added in the next layer's input
    norm kernel (``Qwen3DecoderLayer.deferred``), bit-for-bit the sum ``forward`` makes."""
    pending, taps = None, []
    for i, layer in enumerate(layers):
        x, pending = layer.deferred(x, pending, cos, sin, cache["k"][i], cache["v"][i], block_table,
                                    positions, kv_limit, groups)
        if i in tap_layer_ids:
            taps.append(x + pending)
    return (x if pending is None else x + pending), taps


def use_row_kernels_(model: nn.Module) -> int:
    """Run the bf16 Qwen3 decoder layers of ``model`` whose projections are fused with one launch
    per norm (with its residual add), per q/k norm + RoPE + cache write and per SwiGLU
    (``plugins/kernels/norm_act.py``, ``qk_rope_cache``): what ``LLM`` does on a GPU for the steps
    past the decode chain's rows. -> the layers switched (fused bf16 projections: ``fuse.FusedLinear``;
    fp8 ones keep their own path)."""
    n = 0
    for layer in model.modules():
        if isinstance(layer, Qwen3DecoderLayer) and all(
                p is not None and p.weight.dtype == torch.bfloat16
                for p in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)):
            layer.row_kernels = layer.self_attn.row_kernels = layer.mlp.row_kernels = True
            n += 1
    return n


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
                cache: dict[str, list[Tensor]], groups: SlotGroups | None = None) -> tuple[Tensor, Tensor]:
        """tokens, positions [B, T] (position < 0: padding); block_table [B, pages] ->
        logits [B, T, V], taps [B, T, len(tap_layer_ids) * d]. ``groups``: the rows are the packed
        verify's slots (T = 1), their attention grouped by batch row (``packed_verify.py``)."""
        x = self.model.embed_tokens(tokens.clamp(min=0))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        x, taps = run_layers(self.model.layers, x, cos, sin, cache, block_table, positions, positions,
                             self.tap_layer_ids, groups)
        logits = self.lm_head(self.model.norm(x))
        tap = torch.cat(taps, -1) if taps else x.new_zeros(*x.shape[:2], 0)
        return logits, tap
