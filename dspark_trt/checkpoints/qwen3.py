"""Load a Qwen3 target and its DSpark/DFlash draft from HF checkpoint directories.

Target names are the HF ``Qwen3ForCausalLM`` names. Draft names are those of the published
``Qwen3DSparkModel`` checkpoints (no prefix); ``confidence_head.*`` is accepted and ignored, and
``embed_tokens``/``lm_head`` copies are checked against the target's shapes and not used (the
draft shares the target's frozen modules).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import DSparkConfig, ModelPair, Qwen3Config, read_json
from ..models import build_models
from .files import CheckpointError, load_into_module

log = logging.getLogger(__name__)
SHARED = ("embed_tokens.weight", "lm_head.weight")


def read_target_config(ckpt_dir: str | Path) -> Qwen3Config:
    d = Path(ckpt_dir)
    cfg = Qwen3Config.from_hf(read_json(d / "config.json"))
    gen = d / "generation_config.json"
    if gen.exists():
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_id = [eos] if isinstance(eos, int) else list(eos)
    return cfg


def read_pair_config(target_dir: str | Path, draft_dir: str | Path) -> ModelPair:
    target = read_target_config(target_dir)
    draft = DSparkConfig.from_hf(read_json(Path(draft_dir) / "config.json"))
    return ModelPair(f"{Path(target_dir).name}+{Path(draft_dir).name}", target, draft).validate()


def _draft_rename(name: str) -> str | None:
    if name.startswith("confidence_head.") or name in SHARED:
        return None
    return name


def load_qwen3_pair(target_dir: str | Path, draft_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device="cpu", num_spec_tokens: int | None = None):
    """-> (ModelPair, target module, draft module), weights loaded, eval mode."""
    pair = read_pair_config(target_dir, draft_dir)
    target, draft = build_models(pair, dtype=dtype, device=device, num_spec_tokens=num_spec_tokens)
    tied = pair.target.tie_word_embeddings
    load_into_module(target, target_dir, skip=lambda n: tied and n == "lm_head.weight")
    dropped = load_into_module(draft, draft_dir, rename=_draft_rename,
                               skip=lambda n: n.split(".")[0] in ("embed_tokens", "lm_head"))
    for name in SHARED:
        if name in dropped:
            want = tuple(getattr(draft, name.split(".")[0]).weight.shape)
            if tuple(dropped[name].shape) != want:
                raise CheckpointError(f"draft tensor '{name}' in {draft_dir} has shape "
                                      f"{tuple(dropped[name].shape)}, target has {want}")
            log.info("draft ships %s; using the target's shared copy", name)
    return pair, target, draft


def qwen3_target_tensors(target: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = target.state_dict()
    if target.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def qwen3_draft_tensors(draft: torch.nn.Module, include_shared: bool = True) -> dict[str, torch.Tensor]:
    """State dict in the published draft naming (shared embed/head copies included by default)."""
    return {k: v for k, v in draft.state_dict().items()
            if include_shared or k.split(".")[0] not in ("embed_tokens", "lm_head")}
