"""The networks as plain torch modules, built from configs by architecture name."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelPair

_TARGETS: dict[str, Callable] = {}
_DRAFTS: dict[str, Callable] = {}


def register_arch(target_arch: str, target_factory: Callable, draft_arch: str,
                  draft_factory: Callable) -> None:
    """``target_factory(cfg, tap_layer_ids)``, ``draft_factory(cfg, target)`` -> modules."""
    _TARGETS[target_arch] = target_factory
    _DRAFTS[draft_arch] = draft_factory


def _qwen3_target(cfg, tap_ids):
    from .qwen3 import Qwen3ForCausalLM
    return Qwen3ForCausalLM(cfg, tap_ids)


def _qwen3_draft(cfg, target):
    from .dspark_qwen3 import DSparkQwen3Draft
    return DSparkQwen3Draft(cfg, target.model.embed_tokens, target.lm_head)


register_arch("qwen3", _qwen3_target, "qwen3_dspark", _qwen3_draft)


def _v4_target(cfg, tap_ids):
    from .deepseek_v4 import DeepSeekV4ForCausalLM
    return DeepSeekV4ForCausalLM(cfg, tap_ids)


def _v4_draft(cfg, target):
    from .dspark_v4 import DSparkV4Draft
    return DSparkV4Draft(cfg, target.embed, target.head)


register_arch("deepseek_v4", _v4_target, "deepseek_v4_dspark", _v4_draft)


def build_models(pair: ModelPair, dtype: torch.dtype = torch.float32, device="cpu",
                 seed: int | None = 0) -> tuple[nn.Module, nn.Module]:
    """Instantiate target and draft (random init from ``seed``; loaders overwrite the weights).
    The modules hold weights and shapes; N and the sampler mode are the runtime's arguments."""
    if pair.target.arch not in _TARGETS:
        raise ValueError(f"unknown target architecture '{pair.target.arch}'")
    if pair.draft.arch not in _DRAFTS:
        raise ValueError(f"unknown draft architecture '{pair.draft.arch}'")
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        target = _TARGETS[pair.target.arch](pair.target, pair.draft.target_layer_ids)
        draft = _DRAFTS[pair.draft.arch](pair.draft, target)
    target.to(dtype).eval().requires_grad_(False)
    draft.to(dtype).eval().requires_grad_(False)
    return target, draft
