"""Write the trained models as HF checkpoint directories the project's loaders read.

target/: ``Qwen3ForCausalLM`` names + config.json + generation_config.json + tokenizer.json.
draft/ (DSpark) and dflash/: published DSpark names + config.json, without the shared
embedding/head copies. ar_draft/: a small ``Qwen3ForCausalLM`` checkpoint (loaded with
``load_ar_draft``; it is an evaluation baseline, not a runtime draft).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoints.files import load_into_module, write_checkpoint
from ..checkpoints.qwen3 import qwen3_draft_tensors, qwen3_target_tensors, read_target_config
from ..models.qwen3 import Qwen3ForCausalLM

SAVE_DTYPE = torch.bfloat16
SHARD_LIMIT = 16 * 2**20            # one file that one GPU run can bring back (16 MiB)
SHARD_BYTES = SHARD_LIMIT - 2**20   # tensor bytes per shard: 1 MiB left for the header


def _cast(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(SAVE_DTYPE) for k, v in tensors.items()}


def save_target(out_dir: Path, target, tokenizer_json: str, shard: int | None = None) -> None:
    """``shard``: at most this many tensor bytes per safetensors file (None: one file)."""
    cfg = target.config
    write_checkpoint(out_dir, cfg.to_hf(), _cast(qwen3_target_tensors(target)), shard, extra_files={
        "generation_config.json": json.dumps({"eos_token_id": list(cfg.eos_token_id)}, indent=2),
        "tokenizer.json": tokenizer_json})


def save_draft(out_dir: Path, draft, shard: int | None = None) -> None:
    write_checkpoint(out_dir, draft.config.to_hf(),
                     _cast(qwen3_draft_tensors(draft, include_shared=False)), shard)


def save_ar_draft(out_dir: Path, ar, shard: int | None = None) -> None:
    write_checkpoint(out_dir, ar.config.to_hf(), _cast(qwen3_target_tensors(ar)), shard)


def check_shards(ckpt_dir: str | Path, limit: int = SHARD_LIMIT) -> list[tuple[str, int]]:
    """-> [(file, bytes)] of the checkpoint's safetensors files; ValueError if one is over
    ``limit`` bytes."""
    files = sorted((p.name, p.stat().st_size) for p in Path(ckpt_dir).glob("*.safetensors"))
    over = [(n, b) for n, b in files if b > limit]
    if over:
        raise ValueError(f"{ckpt_dir}: shard(s) over {limit} bytes: {over}")
    return files


def load_target(ckpt_dir: str | Path, tap_layer_ids=(), dtype: torch.dtype = torch.float32,
                device="cpu") -> Qwen3ForCausalLM:
    """A saved target (``save_target``) as a frozen ``Qwen3ForCausalLM`` with its taps."""
    cfg = read_target_config(ckpt_dir)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg, list(tap_layer_ids))
    load_into_module(model, ckpt_dir, skip=lambda n: cfg.tie_word_embeddings and n == "lm_head.weight")
    return model.to(dtype).eval().requires_grad_(False)


def load_ar_draft(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32,
                  device="cpu") -> Qwen3ForCausalLM:
    cfg = read_target_config(ckpt_dir)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    load_into_module(model, ckpt_dir, skip=lambda n: cfg.tie_word_embeddings and n == "lm_head.weight")
    return model.to(dtype).eval().requires_grad_(False)
