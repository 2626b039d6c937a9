"""The one dtype table: names users give (``--dtype``, ``dtype=``, manifests) <-> torch dtypes."""
from __future__ import annotations

import torch

from .checks import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
ENGINE_DTYPES = ("fp32", "bf16", "fp16")       # what ``dspark-trt build`` compiles (fp64: eager runs)


def torch_dtype(name: str, allowed=tuple(DTYPES)) -> torch.dtype:
    """``name`` -> torch dtype; ``ConfigError`` naming the choices for anything else."""
    if name not in allowed:
        raise ConfigError(f"--dtype {name!r}: choose one of {', '.join(allowed)}")
    return DTYPES[name]

