"""DeepSeek-V4 target (algorithm doc §8): hyper-connected blocks of MLA attention and MoE.

``forward(tokens, positions, block_table, cache)`` has the networks interface of the Qwen3
target: T tokens per row at absolute positions (-1 inert), caches written in place, causal
attention (window ``[p - W + 1, p]`` plus the layer kind's compressed entries), logits and taps.
A tap is the mean over the ``hc`` streams of a configured layer's output (after ``hc_post``).
Parameter names follow the V4 checkpoint (``embed``, ``layers.N.attn.wq_a``, ``layers.N.ffn.gate``,
``head``); the loader maps ``hc_attn_fn`` style names onto the ``hc_attn.fn`` submodules.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import DeepSeekV4Config
from .layers import RMSNorm
from .v4_attention import V4Attention
from .v4_hc import HyperConnection, HyperHead
from .v4_layers import check_rows, flat_rows, same_rows
from .v4_moe import MoE


class V4Block(nn.Module):
    """hc_pre -> attn_norm -> attention -> hc_post; hc_pre -> ffn_norm -> MoE -> hc_post."""

    def __init__(self, cfg: DeepSeekV4Config, ratio: int, hashed: bool):
        super().__init__()
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(hc, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.hc_ffn = HyperConnection(hc, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn = V4Attention(cfg, ratio)
        self.ffn = MoE(cfg, hashed)

    def forward(self, x: Tensor, token_ids: Tensor, positions: Tensor, block_table: Tensor,
                cache: dict, window_rows: Tensor) -> Tensor:
        """x [B, T, hc, d] -> [B, T, hc, d]."""
        y, post, comb = self.hc_attn.pre(x)
        y = self.attn(self.attn_norm(y), positions, block_table, cache, window_rows)
        x = self.hc_attn.post(y, x, post, comb)
        y, post, comb = self.hc_ffn.pre(x)
        return self.hc_ffn.post(self.ffn(self.ffn_norm(y), token_ids), x, post, comb)


def causal_window_rows(block_table: Tensor, positions: Tensor, page: int, window: int) -> Tensor:
    """Flat latent rows of positions ``[p - W + 1, p]`` for each token -> [B, T, W] (-1 skip)."""
    B, T = positions.shape
    pos = positions[..., None] - window + 1 + torch.arange(window, device=positions.device)
    pos = torch.where((positions >= 0)[..., None], pos, -1)
    return flat_rows(block_table, pos.flatten(1), page).view(B, T, window)


class DeepSeekV4ForCausalLM(nn.Module):
    """The V4 target network; ``tap_layer_ids`` feed the DSpark draft."""

    def __init__(self, cfg: DeepSeekV4Config, tap_layer_ids: list[int] | tuple[int, ...] = ()):
        super().__init__()
        self.config = cfg
        self.tap_layer_ids = tuple(tap_layer_ids)
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(V4Block(cfg, cfg.layer_ratio(i), i < cfg.num_hash_layers)
                                    for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg.hc_mult, d, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)

    def make_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device) -> dict:
        return {"layers": [layer.attn.make_cache(num_pages, page_size, dtype, device)
                           for layer in self.layers]}

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes this implementation allocates per token position (all layers)."""
        return sum(layer.attn.bytes_per_token(dtype) for layer in self.layers)

    def forward(self, tokens: Tensor, positions: Tensor, block_table: Tensor,
                cache: dict) -> tuple[Tensor, Tensor]:
        """tokens, positions [B, T]; block_table [B, P] -> logits [B, T, V], taps [B, T, m*d]."""
        check_rows(block_table, tokens=tokens, positions=positions)
        positions = same_rows(tokens, positions)
        page = cache["layers"][0]["kv"].shape[2]
        window = causal_window_rows(block_table, positions, page, self.config.sliding_window)
        x = self.embed(tokens.clamp(min=0))
        x = x[:, :, None, :].expand(-1, -1, self.config.hc_mult, -1).contiguous()   # [B, T, hc, d]
        taps = []
        for i, layer in enumerate(self.layers):
            x = layer(x, tokens, positions, block_table, cache["layers"][i], window)
            if i in self.tap_layer_ids:
                taps.append(x.mean(-2))
        logits = self.head(self.norm(self.hc_head(x)))
        tap = torch.cat(taps, -1) if taps else x.new_zeros(*x.shape[:2], 0)
        return logits, tap
