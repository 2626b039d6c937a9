"""Pick the checkpoint loader for a target/draft pair by the target's ``model_type``."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError, read_json

_LOADERS: dict[str, Callable] = {}


def register_loader(model_type: str, fn: Callable) -> None:
    _LOADERS[model_type] = fn


def _qwen3(*args, **kw):
    from .qwen3 import load_qwen3_pair
    return load_qwen3_pair(*args, **kw)


register_loader("qwen3", _qwen3)


def _deepseek_v4(*args, **kw):
    from .v4 import load_v4_pair
    return load_v4_pair(*args, **kw)


register_loader("deepseek_v4", _deepseek_v4)


def load_pair(target_dir: str | Path, draft_dir: str | Path, dtype: torch.dtype = torch.float32,
              device="cpu", quantization: str | None = None):
    """-> (ModelPair, target module, draft module) with weights loaded. ``quantization``
    (``checkpoints.fp8``): Qwen3 and DeepSeek-V4 loaders; the others dequantise ("fp8" refused)."""
    model_type = read_json(Path(target_dir) / "config.json").get("model_type", "qwen3")
    if model_type not in _LOADERS:
        raise ConfigError(f"config field 'model_type': no loader for '{model_type}' "
                          f"(known: {', '.join(sorted(_LOADERS))})")
    kw = {}
    if model_type in ("qwen3", "deepseek_v4"):
        kw = dict(quantization=quantization)
    elif (quantization or "auto") not in ("auto", "none"):
        from .fp8 import check_quantization
        check_quantization(quantization, model_type)
    return _LOADERS[model_type](target_dir, draft_dir, dtype=dtype, device=device, **kw)
