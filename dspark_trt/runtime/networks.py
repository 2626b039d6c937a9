"""The four networks the draft-verify loop drives, behind one interface.

``EagerNetworks`` runs the torch modules directly (the reference path); compiled engines provide
the same methods. KV caches are persistent buffers allocated here and written in place.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import plugins


class EagerNetworks:
    """Target + draft modules with their caches bound; shapes are those of design.md."""

    def __init__(self, target: nn.Module, draft: nn.Module | None, num_slots: int, max_len: int,
                 device, dtype: torch.dtype):
        self.target_module, self.draft_module = target, draft
        self.device, self.dtype = torch.device(device), dtype
        self.num_spec_tokens = draft.num_spec_tokens if draft is not None else 0
        self.vocab_size = target.config.vocab_size
        self.target_cache = target.make_cache(num_slots, max_len, dtype, device)
        self.draft_cache = draft.make_cache(num_slots, max_len, dtype, device) if draft else None

    @torch.inference_mode()
    def target(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """target_prefill / target_verify: tokens [B, T] -> logits [B, T, V], taps [B, T, m*d]."""
        return self.target_module(tokens, positions, slots, self.target_cache)

    @torch.inference_mode()
    def draft_context(self, taps: Tensor, positions: Tensor, slots: Tensor) -> None:
        self.draft_module.context(taps.to(self.dtype), positions, slots, self.draft_cache)

    @torch.inference_mode()
    def draft_block(self, anchor: Tensor, start: Tensor, slots: Tensor, temperature: Tensor,
                    seed: Tensor) -> tuple[Tensor, Tensor]:
        return self.draft_module(anchor, start, slots, temperature, seed, self.draft_cache)

    @torch.inference_mode()
    def verify(self, logits: Tensor, drafts: Tensor, draft_logits: Tensor, temperature: Tensor,
               seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        return plugins.rejection_sample(logits, drafts, draft_logits, temperature, seed, start)
