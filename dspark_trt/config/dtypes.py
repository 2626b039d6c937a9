"""The one dtype table: names users give (``--dtype``, ``dtype=``, manifests) <-> torch dtypes."""
from __future__ import annotations

import torch

from .checks import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
ENGINE_DTYPES = ("fp32", "bf16", "fp16")       # what ``dspark-trt build`` compiles (fp64: eager runs)


AUTO = "auto"                                  # the checkpoint's dtype / the device's default
DTYPE_CHOICES = (AUTO, *DTYPES)
# config.json ``torch_dtype`` (newer HF: ``dtype``) names -> torch dtypes
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float64": torch.float64, "float": torch.float32, "half": torch.float16,
             "double": torch.float64, **DTYPES}


def torch_dtype(name: str, allowed=tuple(DTYPES)) -> torch.dtype:
    """``name`` -> torch dtype; ``ConfigError`` naming the field and the choices otherwise."""
    if not isinstance(name, str) or name not in allowed:
        raise ConfigError(f"dtype {name!r} (--dtype): choose one of {', '.join(allowed)}")
    return DTYPES[name]


def stored_dtype(hf_config: dict) -> torch.dtype | None:
    """The dtype a checkpoint's config.json says its weights are in (``torch_dtype``, or ``dtype``
    in newer transformers); None when it says nothing or names something else (fp8 checkpoints
    name their unquantised dtype here)."""
    name = hf_config.get("torch_dtype", hf_config.get("dtype"))
    return HF_DTYPES.get(str(name).removeprefix("torch.")) if name is not None else None

