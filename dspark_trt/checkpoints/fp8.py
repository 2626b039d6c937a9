"""The target's weight format at load (``ModelSource.quantization``): fp8 block-scaled projections
kept native, quantised, or dequantised.

* ``None`` / "auto": as stored: an FP8 checkpoint (``<linear>.weight_scale_inv`` beside an fp8
  ``weight``, the Qwen3-FP8 layout) or a preset whose target says ``quantization="fp8"`` keeps its
  projections in fp8 (``models.fp8_linear.Fp8Linear``); anything else stays in the model dtype.
* "fp8": the attention / MLP projections in fp8 (a wider checkpoint or random weights are
  quantised at load: scale = block amax / 448).
* "none": fp8 projections dequantised to the model dtype (the old path; for debugging).
Embeddings, norms and lm_head always stay in the model dtype. Qwen3 targets only; tensor parallelism slices the block
scales with the weights (``parallel.layers.fp8_blocks``).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError, ModelPair
from ..config.source import QUANTIZATIONS
from ..models.fp8_linear import Fp8Linear, dequantize_fp8_linears_, fp8_linears_

SCALE_SUFFIX = ".weight_scale_inv"


def check_quantization(mode: str | None, arch: str, tp_world: int = 1) -> str:
    """-> the mode ("auto" for None); ConfigError naming what does not fit."""
    mode = mode or "auto"
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if mode == "fp8" and arch != "qwen3":
        raise ConfigError(f"--quantization fp8: native fp8 weights are implemented for Qwen3 targets "
                          f"only (target arch '{arch}'; DeepSeek-V4 checkpoints are dequantised at load)")
    return mode


def fp8_linear_names(checkpoint_names) -> set[str]:
    """Module names of the linears a checkpoint stores in fp8 (those with a ``weight_scale_inv``)."""
    return {n[:-len(SCALE_SUFFIX)] for n in checkpoint_names if n.endswith(SCALE_SUFFIX)}


def has_fp8(module: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in module.modules())


def apply_quantization_(pair: ModelPair, target: nn.Module, dtype: torch.dtype, mode: str | None,
                        tp_world: int = 1, loaded: bool = False) -> str | None:
    """After the target's weights are in place (``loaded``: from a checkpoint, whose stored
    formats "auto" keeps; else random weights, which "auto" quantises where the config says fp8):
    quantise or dequantise its projections for ``mode``; sets and returns
    ``pair.target.quantization`` (what the target now holds)."""
    mode = check_quantization(mode, pair.target.arch, tp_world)
    preset_fp8 = not loaded and getattr(pair.target, "quantization", None) == "fp8"
    if mode == "none":
        dequantize_fp8_linears_(target, dtype)
    elif mode == "fp8" or (mode == "auto" and preset_fp8):
        fp8_linears_(target, quantize=True)                 # the linears not already fp8
    held = "fp8" if has_fp8(target) else None
    if hasattr(pair.target, "quantization"):
        pair.target.quantization = held
    return held
