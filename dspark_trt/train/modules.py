"""Freshly initialised target, DSpark/DFlash drafts and the autoregressive draft for a recipe.

Drafts share the target's embedding and (tied) lm_head modules; those stay frozen.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.dspark_qwen3 import DSparkQwen3Draft
from ..models.qwen3 import Qwen3ForCausalLM
from .recipe import TrainRecipe


def init_weights(module: nn.Module, std: float) -> None:
    """N(0, std) for every Linear/Embedding weight of ``module`` (norms keep their ones)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)


def build_target(r: TrainRecipe, device, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(r.target_config(), r.tap_layer_ids)
    init_weights(model, r.init_std)
    return model.to(device)


def build_block_draft(r: TrainRecipe, target: Qwen3ForCausalLM, markov_rank: int,
                      seed: int) -> DSparkQwen3Draft:
    """DSpark draft (``markov_rank > 0``) or DFlash draft (0) over the target's frozen modules."""
    torch.manual_seed(seed)
    device = target.lm_head.weight.device
    draft = DSparkQwen3Draft(r.draft_config(markov_rank), target.model.embed_tokens, target.lm_head)
    for name, child in draft.named_children():
        if name not in ("embed_tokens", "lm_head"):
            init_weights(child, r.init_std)
    return draft.to(device)


def build_ar_draft(r: TrainRecipe, target: Qwen3ForCausalLM, seed: int) -> Qwen3ForCausalLM:
    """A ``r.ar_layers``-layer Qwen3 causal LM on tokens, sharing the target's embedding/head."""
    torch.manual_seed(seed)
    ar = Qwen3ForCausalLM(r.ar_config())
    init_weights(ar, r.init_std)
    ar.model.embed_tokens = target.model.embed_tokens
    ar.lm_head = target.lm_head             # tied: the same weight as embed_tokens
    return ar.to(target.lm_head.weight.device)
