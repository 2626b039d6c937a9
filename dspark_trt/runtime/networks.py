"""The four networks the draft-verify loop drives, behind one interface.

``EagerNetworks`` runs the torch modules directly (the reference path); compiled engines provide
the same methods. KV caches are persistent buffers allocated here and written in place.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from .. import plugins
from ..config.source import resolve_num_spec_tokens
from ..models.dspark_qwen3 import markov_sampler_op, window_rows

DECODE_CHAIN_ENV = "DSPARK_DECODE_CHAIN"   # the target's decode steps and the draft's block passes
                                           # through runtime/token_step.py: "auto" / "1" / "0"
DECODE_CHAIN_DEFAULT = "auto"   # the GPU tests with it, session 32 (H100): 119 passed, the 6 others not the chain's


ROW_KERNELS_ENV = "DSPARK_ROW_KERNELS"     # "0": the eager layers' torch elementwise ops on a GPU too


def row_kernels_flag() -> bool:
    """Whether ``LLM``'s eager bf16 Qwen3 target and DSpark draft on a GPU run their steps past the
    decode chain with the row kernels (``models.qwen3.use_row_kernels_``): unless
    ``DSPARK_ROW_KERNELS=0``."""
    return os.environ.get(ROW_KERNELS_ENV, "") != "0"


def decode_chain_flag() -> str | None:
    """``DSPARK_DECODE_CHAIN`` (unset or empty: ``DECODE_CHAIN_DEFAULT``): "auto" (the chain wherever
    it can run), "1" (asked for: an error where it cannot), other values as given; None for "0"."""
    flag = os.environ.get(DECODE_CHAIN_ENV, "") or DECODE_CHAIN_DEFAULT
    return None if flag == "0" else flag


def _fitting(chain, tokens: int):
    """``chain`` (a ``token_step.TokenStep`` or None) where it takes a step of ``tokens`` tokens
    (at most its ``max_rows``), else None: the modules run it."""
    return chain if chain is not None and tokens <= chain.max_rows else None


class EagerNetworks:
    """Target + draft modules with their caches bound; shapes are those of design.md."""

    def __init__(self, target: nn.Module, draft: nn.Module | None, num_pages: int, page_size: int,
                 device, dtype: torch.dtype, markov_sampler: str | None = None,
                 num_spec_tokens: int | None = None):
        """Run settings are held here and passed to every draft block, not stored on the modules:
        ``markov_sampler``, the draft's Markov sampler mode (None: exact; an engine's is compiled
        in), and ``num_spec_tokens``, N (None: the draft's trained ``config.block_size``; 0
        without a draft). KV caches hold the modules' local heads (sharded by ``parallel``)."""
        self.target_module, self.draft_module = target, draft
        if markov_sampler is not None:
            markov_sampler_op(markov_sampler)                        # validates the name
        self.markov_sampler = markov_sampler or "exact"
        self.device, self.dtype = torch.device(device), dtype
        self.num_spec_tokens = (resolve_num_spec_tokens(num_spec_tokens, draft.config)
                                if draft is not None else 0)
        self.vocab_size = target.config.vocab_size
        self.num_pages, self.page_size = num_pages, page_size
        self.target_cache = target.make_cache(num_pages, page_size, dtype, device)
        self.draft_cache = draft.make_cache(num_pages, page_size, dtype, device) if draft else None
        self.has_confidence = getattr(draft, "confidence_head", None) is not None
        self.packs_rows = getattr(target, "packs_rows", False)     # packed verify (packed_verify.py)
        self.decode_chain = None       # runtime/token_step.TokenStep: the steps of <= its max_rows tokens
        self.draft_chain = None        # ... of the draft: its block passes of <= max_rows tokens

    @torch.inference_mode()
    def target(self, tokens: Tensor, positions: Tensor, block_table: Tensor,
               groups=None) -> tuple[Tensor, Tensor]:
        """target_prefill / target_verify: tokens [B, T] -> logits [B, T, V], taps [B, T, m*d]
        (a decode step of few tokens through ``decode_chain`` where one is set). ``groups``: the
        packed verify's ``SlotGroups`` (``packed_verify.py``), for the modules' attention (the
        chain attends each slot on its own)."""
        if (chain := _fitting(self.decode_chain, tokens.numel())) is not None:
            return chain(tokens, positions, self.target_cache, block_table)
        if groups is not None:
            return self.target_module(tokens, positions, block_table, self.target_cache, groups=groups)
        return self.target_module(tokens, positions, block_table, self.target_cache)

    @torch.inference_mode()
    def draft_context(self, taps: Tensor, positions: Tensor, block_table: Tensor) -> None:
        self.draft_module.context(taps.to(self.dtype), positions, block_table, self.draft_cache)

    @torch.inference_mode()
    def draft_block(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                    seed: Tensor, width: int | None = None, z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> drafts [B, w], z [B, w, V]: the first ``width`` (None: all N) drafts of the block
        (the block pass through ``draft_chain`` where one is set and the block is small enough);
        ``z_out``: a buffer for z (``dspark_qwen3.sample_block``)."""
        if (chain := _fitting(self.draft_chain, anchor.shape[0] * self.num_spec_tokens)) is not None:
            U = chain.draft_logits(anchor, start, self.draft_cache, block_table, self.num_spec_tokens)
            return self.draft_module.sample(window_rows(U, width), anchor, temperature, seed, start,
                                            self.markov_sampler, z_out=z_out)
        return self.draft_module(anchor, start, block_table, temperature, seed, self.draft_cache,
                                 sampler=self.markov_sampler, num_spec_tokens=self.num_spec_tokens,
                                 width=width, z_out=z_out)

    @torch.inference_mode()
    def draft_block_confidence(self, anchor: Tensor, start: Tensor, block_table: Tensor,
                               temperature: Tensor, seed: Tensor, width: int | None = None,
                               z_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """draft_block + the confidence logits [B, w] of its first ``width`` (None: all N) drafts,
        from the same forward (through ``draft_chain`` as ``draft_block``)."""
        if (chain := _fitting(self.draft_chain, anchor.shape[0] * self.num_spec_tokens)) is not None:
            U, h = chain.draft_logits(anchor, start, self.draft_cache, block_table, self.num_spec_tokens,
                                      hidden=True)
            return self.draft_module.sample(window_rows(U, width), anchor, temperature, seed, start,
                                            self.markov_sampler, window_rows(h, width), z_out)
        return self.draft_module(anchor, start, block_table, temperature, seed, self.draft_cache,
                                 with_confidence=True, sampler=self.markov_sampler,
                                 num_spec_tokens=self.num_spec_tokens, width=width, z_out=z_out)

    @torch.inference_mode()
    def verify(self, logits: Tensor, drafts: Tensor, draft_logits: Tensor, temperature: Tensor,
               seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        return plugins.rejection_sample(logits, drafts, draft_logits, temperature, seed, start)
