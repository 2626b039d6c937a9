"""Load a DeepSeek-V4 target and its DSpark draft from checkpoints in the real V4 naming (doc §9.4).

* Target: top-level names (``embed.weight``, ``layers.N.*``, ``head.weight``, ...).
* Draft: ``mtp.{s}.*`` (read from ``draft_dir``, which may be the target directory itself):
  head-level names (``main_proj.``, ``main_norm.``, ``norm.``, ``hc_head_*``, ``markov_head.``)
  go to the draft module whatever the stage, everything else to stage ``layers.{s}.``;
  ``confidence_head.proj.weight`` ([1, d + r], no bias, on the pre-norm ``hc_head`` output) is
  loaded from any stage (the release has it on the last, some loaders put it on ``mtp.0``).
* ``.scale`` is aliased to ``.weight_scale`` for fp4 routed experts (MXFP4, per-32 scales) and to
  ``.weight_scale_inv`` everywhere else (128x128 block fp8); a weight with a scale is dequantised
  to the model dtype (reference path), except with ``quantization="fp8"``: the fp8 linears of
  ``V4_FP8_MODULES`` and the target's MXFP4 routed experts (``Mxfp4Linear``: packed bytes + E8M0
  scales as stored, a wide checkpoint's quantised with ``quant_mxfp4``) stay native.
  ``hc_{attn,ffn,head}_{fn,base,scale}`` map onto the ``hc_*`` submodules. Errors name the tensor
  and its file.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import DeepSeekV4Config, DSparkV4Config, ModelPair, read_json
from ..models import build_models
from .files import CheckpointError, check_finite, checkpoint_files, read_tensors
from .quant import (QuantFormatError, check_fp8_block, check_mxfp4, dequant_fp8_block, dequant_mxfp4,
                    e8m0_to_float, quant_fp8_block, quant_mxfp4, quant_mxfp4_u8)

HEAD_LEVEL = ("main_proj.", "main_norm.", "norm.", "hc_head_fn", "hc_head_base", "hc_head_scale",
              "markov_head.")
_EXPERT_SCALE = re.compile(r"\.experts\.\d+\.w[123]\.scale$")
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_HC = re.compile(r"(^|\.)(hc_attn|hc_ffn|hc_head)_(fn|base|scale)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.*)$")
FP8_WEIGHTS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]"
                         r"|^main_proj)\.weight$")


def remap_name(name: str, expert_dtype: str = "fp4") -> tuple[str, str] | None:
    """Checkpoint name -> ("target" | "draft", module name), None for dropped tensors."""
    m = _MTP.match(name)
    if m is None:
        side, rest = "target", name
    else:
        stage, rest = m.groups()
        if rest.startswith("confidence_head."):
            return "draft", rest
        side = "draft"
        if not rest.startswith(HEAD_LEVEL):
            rest = f"layers.{stage}.{rest}"
    if rest.endswith(".scale"):
        fp4 = _EXPERT_SCALE.search(rest) is not None and expert_dtype == "fp4"
        rest = rest[:-len(".scale")] + (".weight_scale" if fp4 else ".weight_scale_inv")
    rest = _HC.sub(lambda g: f"{g.group(1)}{g.group(2)}.{g.group(3)}", rest)
    return side, rest


def _dequantise(name: str, w: torch.Tensor, scales: dict, where: str) -> torch.Tensor:
    base = name[:-len(".weight")] if name.endswith(".weight") else None
    try:
        if base is not None and f"{base}.weight_scale" in scales:
            return dequant_mxfp4(w, scales.pop(f"{base}.weight_scale"))
        if base is not None and f"{base}.weight_scale_inv" in scales:
            return dequant_fp8_block(w, scales.pop(f"{base}.weight_scale_inv"))
    except QuantFormatError as e:
        raise CheckpointError(f"tensor '{where}': {e}") from None
    return w


def _native_fp8(name: str, w: torch.Tensor, scales: dict, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 block scales) for an ``Fp8Linear`` parameter ``name``: as stored (E8M0 or
    fp32 scales), or quantised when the checkpoint holds it wide (no scale)."""
    base = name[:-len(".weight")]
    scale = scales.pop(f"{base}.weight_scale_inv", None)
    if scale is None:                                     # E8M0 (power-of-two) scales, as the release
        q, s = quant_fp8_block(w.float())
        return q, e8m0_to_float(s)
    try:
        check_fp8_block(w, scale)
        return w, scale if scale.dtype == torch.float32 else e8m0_to_float(scale)
    except QuantFormatError as e:
        raise CheckpointError(f"tensor '{where}': {e}") from None


def _native_mxfp4(name: str, w: torch.Tensor, scales: dict, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8, E8M0 uint8) for an ``Mxfp4Linear`` buffer ``name``: as stored, or quantised
    when the checkpoint holds the weight wide (no scale)."""
    scale = scales.pop(f"{name[:-len('.weight')]}.weight_scale", None)
    try:
        if scale is None and w.is_floating_point():
            return quant_mxfp4_u8(w)
        if scale is None:
            raise QuantFormatError(f"MXFP4 weight {w.dtype} {tuple(w.shape)} has no scale next to it")
        check_mxfp4(w, scale)
        if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu) or bool((scale.view(torch.uint8) == 255).any()):
            raise QuantFormatError(f"MXFP4 scale must be E8M0 bytes (uint8 / float8_e8m0fnu) without 255 (NaN), "
                                   f"got {scale.dtype}")
    except QuantFormatError as e:
        raise CheckpointError(f"tensor '{where}': {e}") from None
    return w.view(torch.uint8), scale.view(torch.uint8)


def _load(module: torch.nn.Module, tensors: dict[str, tuple[str, torch.Tensor, Path]],
          skip_prefixes: tuple[str, ...] = ()) -> None:
    """tensors: module name -> (checkpoint name, tensor, file). All-or-nothing copy. A float8
    parameter (an ``Fp8Linear`` of ``--quantization fp8``) and an ``Mxfp4Linear`` take their
    weight and scales as stored (a wide weight is quantised); every other quantised weight is
    dequantised."""
    from ..models.mxfp4_linear import Mxfp4Linear
    scale_suffix = (".weight_scale", ".weight_scale_inv")
    scales = {n: t for n, (_, t, _) in tensors.items() if n.endswith(scale_suffix)}
    files = {n: f"{c}' in {f}" for n, (c, _, f) in tensors.items()}
    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    mxfp4 = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, Mxfp4Linear)}
    values = {}
    for n, (c, t, f) in tensors.items():
        if n.endswith(scale_suffix):
            continue
        if n not in targets:
            raise CheckpointError(f"unexpected tensor '{files[n]} (no parameter '{n}' in "
                                  f"{type(module).__name__})")
        if targets[n].dtype == torch.float8_e4m3fn:
            scale_name = n[:-len("weight")] + "weight_scale_inv"
            values[n], values[scale_name] = _native_fp8(n, t, scales, files[n])
            files.setdefault(scale_name, files[n])           # quantised here: name the weight
        elif n in mxfp4:
            scale_name = n[:-len("weight")] + "weight_scale"
            values[n], values[scale_name] = _native_mxfp4(n, t, scales, files[n])
            files.setdefault(scale_name, files[n])
        else:
            values[n] = _dequantise(n, t, scales, files[n])
    if scales:
        n = next(iter(scales))
        raise CheckpointError(f"scale tensor '{files[n]} has no quantised weight next to it")
    missing = [n for n in targets if n not in values and not n.startswith(skip_prefixes)]
    if missing:
        raise CheckpointError(f"tensor for parameter '{missing[0]}' is missing from the checkpoint "
                              f"({len(missing)} missing in all)")
    for n, v in values.items():
        p = targets[n]
        if tuple(v.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor '{files[n]} has shape {tuple(v.shape)} (dequantised), "
                                  f"expected {tuple(p.shape)}")
        if p.is_floating_point() != v.is_floating_point():
            raise CheckpointError(f"tensor '{files[n]} has dtype {v.dtype}, expected {p.dtype}")
        check_finite(v, f"'{files[n]} (dequantised)")
    with torch.no_grad():
        for n, v in values.items():
            targets[n].copy_(v)


def read_v4_pair_config(target_dir: str | Path, draft_dir: str | Path) -> ModelPair:
    target = DeepSeekV4Config.from_hf(read_json(Path(target_dir) / "config.json"))
    draft = DSparkV4Config.from_hf(read_json(Path(draft_dir) / "config.json"))
    return ModelPair(f"{Path(target_dir).name}+{Path(draft_dir).name}", target, draft).validate()


def _collect(ckpt_dir, side: str, expert_dtype: str) -> dict:
    files = checkpoint_files(ckpt_dir)
    names = [n for n in files if (n.startswith("mtp.") == (side == "draft"))]
    out = {}
    for cname, t in read_tensors(ckpt_dir, names).items():
        mapped = remap_name(cname, expert_dtype)
        if mapped is not None:
            out[mapped[1]] = (cname, t, files[cname])
    return out


def load_v4_pair(target_dir: str | Path, draft_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device="cpu", quantization: str | None = None):
    """-> (ModelPair, target module, draft module), weights loaded, eval mode: dequantised, or with
    ``quantization="fp8"`` the target's ``V4_FP8_MODULES`` linears kept in fp8 (``Fp8Linear``)
    and, with ``expert_dtype`` fp4, its routed experts in MXFP4 (``Mxfp4Linear``; a wide
    checkpoint's are quantised)."""
    from ..models.fp8_linear import fp8_linears_
    from ..models.mxfp4_linear import mxfp4_experts_
    from .fp8 import W8A8, check_quantization, fp8_activations_, fp8_module_names, weight_mode
    requested = check_quantization(quantization, "deepseek_v4")
    mode = weight_mode(requested)
    pair = read_v4_pair_config(target_dir, draft_dir)
    target, draft = build_models(pair, dtype=dtype, device=device)
    if mode == "fp8":
        fp8_linears_(target, fp8_module_names("deepseek_v4", target), quantize=False)
        if pair.target.expert_dtype == "fp4":
            mxfp4_experts_(target)
    ed = pair.target.expert_dtype
    _load(target, _collect(target_dir, "target", ed))
    tensors = _collect(draft_dir, "draft", ed)
    if any(n.startswith("confidence_head.") for n in tensors) and draft.confidence_head is None:
        if draft.markov_head is None:
            raise CheckpointError(f"draft {draft_dir} ships confidence_head.* but has no Markov head "
                                  f"(dspark_markov_rank 0)")
        draft.add_confidence_head()
    _load(draft, tensors, skip_prefixes=("embed.", "head."))
    if requested == W8A8:
        fp8_activations_(target)
    return pair, target, draft


# ---- writing (tests, tools) --------------------------------------------------------------------

def _checkpoint_name(module_name: str, side: str) -> str:
    name = re.sub(r"(^|\.)(hc_attn|hc_ffn|hc_head)\.(fn|base|scale)$", r"\1\2_\3", module_name)
    if side == "target":
        return name
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if m:
        return f"mtp.{m.group(1)}.{m.group(2)}"
    return f"mtp.0.{name}" if name.startswith(("main_proj.", "main_norm.")) else f"mtp.LAST.{name}"


def v4_checkpoint_tensors(target: torch.nn.Module, draft: torch.nn.Module, quantize: bool = True,
                          expert_dtype: str = "fp4") -> dict[str, torch.Tensor]:
    """Both modules' weights in the V4 checkpoint naming, optionally quantised like the release
    (fp8 blocks for attention / shared experts / main_proj; fp4 or fp8 routed experts)."""
    out: dict[str, torch.Tensor] = {}
    last = len(draft.layers) - 1
    sides = [("target", target.state_dict()),
             ("draft", {k: v for k, v in draft.state_dict().items()
                        if not k.startswith(("embed.", "head."))})]
    for side, sd in sides:
        for mname, t in sd.items():
            name = _checkpoint_name(mname, side).replace("mtp.LAST.", f"mtp.{last}.")
            local = name.split(".", 2)[-1] if side == "draft" and name.startswith("mtp.") else name
            if quantize and _EXPERT_WEIGHT.search(name) and expert_dtype == "fp4":
                out[name], out[name[:-len("weight")] + "scale"] = quant_mxfp4(t.float())
            elif quantize and (_EXPERT_WEIGHT.search(name) or FP8_WEIGHTS.search(local)):
                out[name], out[name[:-len("weight")] + "scale"] = quant_fp8_block(t.float())
            else:
                out[name] = t
    return out
