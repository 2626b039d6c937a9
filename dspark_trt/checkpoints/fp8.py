"""The target's weight format at load (``ModelSource.quantization``): fp8 block-scaled projections
kept native, quantised, or dequantised.

* ``None`` / "auto": as stored: an FP8 checkpoint (``<linear>.weight_scale_inv`` beside an fp8
  ``weight``, the Qwen3-FP8 layout) or a preset whose target says ``quantization="fp8"`` keeps its
  projections in fp8 (``models.fp8_linear.Fp8Linear``); anything else stays in the model dtype.
* "fp8": the attention / MLP projections in fp8 (a wider checkpoint or random weights are
  quantised at load: scale = block amax / 448).
* "fp8-w8a8": "fp8", and every fp8 projection quantises its input per (token, 128 columns) to
  fp8 e4m3 as well (``Fp8Linear.act_quant``: fp8 tensor-core GEMMs; what the FP8 checkpoints'
  ``activation_scheme: dynamic`` and vLLM's block-fp8 linears compute). The weights are loaded or
  quantised as with "fp8" (``weight_mode``), then ``fp8_activations_`` switches the linears
  (tensor-parallel shards keep the switch).
* "none": fp8 projections dequantised to the model dtype (the old path; for debugging).
Embeddings, norms and lm_head always stay in the model dtype. Qwen3 targets, and the DeepSeek-V4
linears of ``V4_FP8_MODULES`` with ``--quantization fp8`` ("auto" still dequantises a V4
checkpoint); tensor parallelism slices the block scales with the weights
(``parallel.layers.fp8_blocks``). DeepSeek-V4's routed experts go with them in MXFP4
(``models.mxfp4_linear``; random weights quantised with ``quant_mxfp4``, a shard must keep whole
32-column scale groups: ``parallel.layers.mxfp4_groups``).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..config import ConfigError, ModelPair
from ..config.source import DRAFT_QUANTIZATIONS, QUANTIZATIONS
from ..models.fp8_linear import Fp8Linear, dequantize_fp8_linears_, fp8_linears_
from ..models.mxfp4_linear import dequantize_mxfp4_linears_, mxfp4_experts_
from .quant import quant_mxfp4_u8

SCALE_SUFFIX = ".weight_scale_inv"
# DeepSeek-V4 target linears kept in fp8 by --quantization fp8: those its release stores as 128x128
# fp8 blocks and whose module runs as a linear (``wo_a`` is read as a grouped einsum weight and
# stays dequantised; the routed experts stay MXFP4, ``Mxfp4Linear``)
V4_FP8_MODULES = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_b)|indexer\.wq_b|shared_experts\.w[123])$")


W8A8 = "fp8-w8a8"


def check_quantization(mode: str | None, arch: str) -> str:
    """-> the mode ("auto" for None); ConfigError naming what does not fit."""
    mode = mode or "auto"
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if mode in ("fp8", W8A8) and arch not in ("qwen3", "deepseek_v4"):
        raise ConfigError(f"--quantization {mode}: native fp8 weights are implemented for Qwen3 and "
                          f"DeepSeek-V4 targets only (target arch '{arch}')")
    return mode


def weight_mode(mode: str | None) -> str | None:
    """The weight format a quantization mode loads: "fp8-w8a8" loads as "fp8"."""
    return "fp8" if mode == W8A8 else mode


def fp8_activations_(module: nn.Module) -> int:
    """Let every ``Fp8Linear`` in ``module`` quantise its input too (W8A8); returns how many.
    ConfigError when there are none (nothing would change)."""
    linears = [m for m in module.modules() if isinstance(m, Fp8Linear)]
    if not linears:
        raise ConfigError(f"--quantization {W8A8}: the target has no fp8 projections to run W8A8")
    for m in linears:
        m.act_quant = True
    return len(linears)


def fp8_linear_names(checkpoint_names) -> set[str]:
    """Module names of the linears a checkpoint stores in fp8 (those with a ``weight_scale_inv``)."""
    return {n[:-len(SCALE_SUFFIX)] for n in checkpoint_names if n.endswith(SCALE_SUFFIX)}


def fp8_module_names(arch: str, target: nn.Module) -> set[str] | None:
    """The target linears ``--quantization fp8`` puts in fp8: None (``FP8_PROJECTIONS``) for Qwen3,
    the ``V4_FP8_MODULES`` plain linears for DeepSeek-V4."""
    if arch != "deepseek_v4":
        return None
    return {n for n, m in target.named_modules() if type(m) is nn.Linear and V4_FP8_MODULES.search(n)}


def has_fp8(module: nn.Module) -> bool:
    """Whether ``module`` holds fp8 projections (``Fp8Linear``, fused or not)."""
    from ..models.fuse import FusedFp8Linear
    return any(isinstance(m, (Fp8Linear, FusedFp8Linear)) for m in module.modules())


def check_draft_quantization(mode: str | None, draft_arch: str | None = None, tp_size: int = 1) -> str:
    """-> the draft's mode ("none" for None); ConfigError naming what does not fit (``draft_arch``
    None: not known yet, not checked)."""
    mode = mode or "none"
    if mode not in DRAFT_QUANTIZATIONS:
        raise ConfigError(f"--draft-quantization {mode!r}: choose one of {', '.join(DRAFT_QUANTIZATIONS)}")
    if mode == "fp8" and draft_arch not in (None, "qwen3_dspark"):
        raise ConfigError(f"--draft-quantization fp8: implemented for DSpark drafts of Qwen3 targets only "
                          f"(draft arch '{draft_arch}')")
    if mode == "fp8" and tp_size > 1:
        raise ConfigError(f"--draft-quantization fp8: not with tensor parallelism yet (--tp-size {tp_size})")
    return mode


def quantize_draft_(draft: nn.Module, mode: str | None) -> int:
    """The draft's attention / MLP projections (``FP8_PROJECTIONS``) in fp8 for ``mode`` "fp8"
    (weight-only, scale = block amax / 448, as ``--quantization fp8`` does to a target); returns how
    many. Its fc, norms, head and Markov tables keep their dtype. The speculative loop stays lossless:
    the target verifies; only which drafts it accepts can change."""
    if (mode or "none") == "none":
        return 0
    count = fp8_linears_(draft, None, quantize=True)
    if not count:
        raise ConfigError("--draft-quantization fp8: the draft has no attention / MLP projections to quantise")
    return count


def apply_quantization_(pair: ModelPair, target: nn.Module, dtype: torch.dtype, mode: str | None,
                        loaded: bool = False) -> str | None:
    """After the target's weights are in place (``loaded``: from a checkpoint, whose stored
    formats "auto" keeps; else random weights, which "auto" quantises where the config says fp8):
    quantise or dequantise its projections for ``mode``; sets and returns
    ``pair.target.quantization`` (what the target now holds)."""
    requested = check_quantization(mode, pair.target.arch)
    mode = weight_mode(requested)
    preset_fp8 = not loaded and getattr(pair.target, "quantization", None) == "fp8"
    if mode == "none":
        dequantize_fp8_linears_(target, dtype)
        dequantize_mxfp4_linears_(target, dtype)
    elif mode == "fp8" or (mode == "auto" and preset_fp8):
        fp8_linears_(target, fp8_module_names(pair.target.arch, target), quantize=True)
        if pair.target.arch == "deepseek_v4" and pair.target.expert_dtype == "fp4":
            mxfp4_experts_(target, quant_mxfp4_u8)
    if requested == W8A8:
        fp8_activations_(target)
    held = "fp8" if has_fp8(target) else None
    if hasattr(pair.target, "quantization"):
        pair.target.quantization = held
    return held
