"""DSpark draft for a DeepSeek-V4 target (algorithm doc §9).

* ``context``: ``main_x = main_norm(main_proj(cat(taps)))`` (taps: stream means of the target's
  tap layers); each stage writes ``rope(kv_norm(wkv(main_x)))`` at the context rows' positions
  into its own window cache (no query, no MoE, no norm before ``wkv``).
* ``block``: N tokens ``[anchor, noise × (N-1)]`` at ``P .. P+N-1``, repeated to the hc streams,
  run through the SWA-only stages (``V4Block`` with ratio 0, score-routed MoE). Every query
  attends to the same non-causal list ``[max(P - W, 0), P + N)`` built by
  ``dspark::noncausal_swa_indices``; then ``U = head(norm(hc_head(x)))`` with the target's head.
* ``forward`` (draft_block network): block + ``dspark::markov_sample`` -> drafts, logits z (+ the
  confidence logits with ``with_confidence``: ``proj`` [1, d + r], no bias, on the pre-norm
  ``hc_head`` output concatenated with ``W1[x_{k-1}]``; checkpoint name
  ``mtp.{s}.confidence_head.proj.weight``, any stage).

Names follow vLLM's remap of the checkpoint's ``mtp.{s}.*``: stages are ``layers.{s}.*``; head-
level tensors (``main_proj``, ``main_norm``, ``norm``, ``hc_head``, ``markov_head``) sit on the
module. ``embed``/``head`` are the target's modules, shared.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import plugins
from ..config import DSparkV4Config
from ..config.source import resolve_num_spec_tokens
from ..plugins.noncausal_swa_indices import index_width
from .deepseek_v4 import V4Block
from .dspark_qwen3 import (ConfidenceHead, MarkovHead, confidence_logits, markov_weights, sample_drafts,
                           window_rows)
from .layers import RMSNorm
from .v4_hc import HyperHead
from .v4_layers import check_rows, same_rows


class DSparkV4Draft(nn.Module):
    """Weights and shapes only: N and the sampler mode are arguments (as ``DSparkQwen3Draft``)."""

    def __init__(self, cfg: DSparkV4Config, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.config = cfg
        b = cfg.backbone
        d = b.hidden_size
        self.embed, self.head = embed, head                  # the target's (frozen, shared)
        self.main_proj = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.main_norm = RMSNorm(d, b.rms_norm_eps)
        self.layers = nn.ModuleList(V4Block(b, cfg.stage_ratio(s), hashed=False)
                                    for s in range(cfg.num_stages))
        self.hc_head = HyperHead(b.hc_mult, d, b.hc_eps, b.rms_norm_eps)
        self.norm = RMSNorm(d, b.rms_norm_eps)
        self.markov_head = MarkovHead(b.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence_head = None           # attached by the loader when the checkpoint has one
        self.draft_vocab = None               # draft_vocab.restrict_draft_vocab_

    def add_confidence_head(self) -> ConfidenceHead:
        """Attach a head ``proj`` [1, d + r] without bias (DeepSeek-V4). Needs a Markov head."""
        if self.markov_head is None:
            raise ValueError("a confidence head needs the Markov head (markov_rank > 0)")
        p = self.main_proj.weight
        d, r = self.config.backbone.hidden_size, self.config.markov_rank
        self.confidence_head = ConfidenceHead(d + r, bias=False).to(device=p.device, dtype=p.dtype)
        return self.confidence_head

    def make_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device) -> dict:
        return {"layers": [s.attn.make_cache(num_pages, page_size, dtype, device) for s in self.layers]}

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(s.attn.bytes_per_token(dtype) for s in self.layers)

    def markov_weights(self) -> tuple[Tensor, Tensor]:
        return markov_weights(self, self.head.weight)

    def context(self, taps: Tensor, positions: Tensor, block_table: Tensor, cache: dict) -> None:
        """taps [B, T, m*d] of committed target rows at positions [B, T] (-1 = skip)."""
        check_rows(block_table, positions=positions, taps=taps)
        positions = same_rows(taps, positions)
        main_x = self.main_norm(self.main_proj(taps))
        for s, stage in enumerate(self.layers):
            stage.attn.write_context(main_x, positions, block_table, cache["layers"][s])

    def block(self, anchor: Tensor, start: Tensor, block_table: Tensor, cache: dict,
              num_spec_tokens: int | None = None) -> Tensor:
        """anchor [B] at position start [B] (= P) -> base logits U [B, N, V] (row k predicts P+k+1;
        a draft vocabulary's [B, N, Vs]); N = ``num_spec_tokens`` (None: the trained ``config.block_size``)."""
        return self.head(self.norm(self.block_hidden(anchor, start, block_table, cache, num_spec_tokens)))

    def block_hidden(self, anchor: Tensor, start: Tensor, block_table: Tensor, cache: dict,
                     num_spec_tokens: int | None = None) -> Tensor:
        """The pre-norm ``hc_head`` output h [B, N, d] (``U = head(norm(h))``)."""
        check_rows(block_table, anchor=anchor, start=start)
        start = same_rows(anchor, start)
        B, N = anchor.shape[0], resolve_num_spec_tokens(num_spec_tokens, self.config)
        b = self.config.backbone
        live = (anchor >= 0) & (start >= 0)
        start = torch.where(live, start, -1)
        noise = torch.full((B, N - 1), self.config.mask_token_id, dtype=anchor.dtype,
                           device=anchor.device)
        tokens = torch.cat([anchor[:, None], noise], 1)                         # [B, N]
        positions = torch.where(live[:, None], start[:, None] + torch.arange(N, device=anchor.device), -1)
        page = cache["layers"][0]["kv"].shape[2]
        W = b.sliding_window
        idx, _ = plugins.noncausal_swa_indices(start, block_table, N, page, W, index_width(W, N))
        idx = idx.long()                                                        # [B, N, width]
        x = self.embed(tokens.clamp(min=0))
        x = x[:, :, None, :].expand(-1, -1, b.hc_mult, -1).contiguous()         # [B, N, hc, d]
        for s, stage in enumerate(self.layers):
            x = stage(x, tokens, positions, block_table, cache["layers"][s], idx)
        return self.hc_head(x)

    def forward(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                seed: Tensor, cache: dict, with_confidence: bool = False,
                sampler: str = "exact", num_spec_tokens: int | None = None, width: int | None = None,
                z_out: Tensor | None = None):
        """The draft_block network: drafts [B, N] and their proposal logits z [B, N, V]
        (+ confidence logits [B, N] with ``with_confidence``; needs ``confidence_head``).
        ``sampler``: the Markov sampler mode; ``num_spec_tokens``: N (None: ``config.block_size``);
        both are run settings the caller passes (the runtime's networks, the export wrapper).
        ``width`` (< N): sample only the first ``width`` drafts: the block pass is the N-token one
        (the same hidden states), the head and the sequential sampler run on ``width`` rows.
        ``z_out``: a buffer for z (``sample_block``)."""
        h = window_rows(self.block_hidden(anchor, start, block_table, cache, num_spec_tokens), width)
        U = self.head(self.norm(h))
        drafts, z = sample_drafts(self, sampler, U, anchor, temperature, seed, start, z_out)
        if not with_confidence:
            return drafts, z
        return drafts, z, confidence_logits(self, h, anchor, drafts)
