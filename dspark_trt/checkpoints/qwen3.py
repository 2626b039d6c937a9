"""Load a Qwen3 target and its DSpark/DFlash draft from HF checkpoint directories.

Target names are the HF ``Qwen3ForCausalLM`` names. Draft names are those of the published
``Qwen3DSparkModel`` checkpoints (no prefix); ``embed_tokens``/``lm_head`` copies are checked
against the target's shapes and not used (the draft shares the target's frozen modules).

Confidence head (paper eq. 7): ``confidence_head.proj.weight [1, d + r]`` and ``.bias [1]`` are
loaded from the checkpoint when present (whatever ``enable_confidence_head`` says), else from the
side file ``confidence_head.safetensors`` that ``dspark-trt train`` writes beside a draft (keys
``confidence_head.proj.*``, or the older ``confidence_head.{weight,bias}``). A draft whose config
enables the head but ships none loads without it (the confidence modes are then refused).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import DSparkConfig, ModelPair, Qwen3Config, read_json
from ..models import build_models
from ..models.fp8_linear import fp8_linears_
from ..models.fuse import unfused_state_dict
from .files import CheckpointError, checkpoint_files, load_into_module

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


CONFIDENCE_SIDE_FILE = "confidence_head.safetensors"
CONFIDENCE_NAMES = ("confidence_head.proj.weight", "confidence_head.proj.bias")
_LEGACY_CONFIDENCE = {"confidence_head.weight": "confidence_head.proj.weight",
                      "confidence_head.bias": "confidence_head.proj.bias"}


def _draft_rename(name: str) -> str | None:
    return None if name in SHARED else name


def read_confidence_side_file(draft_dir: str | Path) -> dict[str, torch.Tensor] | None:
    """The side file's tensors under the published names (None when there is no side file)."""
    from safetensors.torch import load_file
    path = Path(draft_dir) / CONFIDENCE_SIDE_FILE
    if not path.exists():
        return None
    try:
        raw = load_file(str(path))
    except Exception as e:           # noqa: BLE001  (safetensors raises several types)
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    out = {_LEGACY_CONFIDENCE.get(k, k): v for k, v in raw.items()}
    bad = sorted(set(out) - set(CONFIDENCE_NAMES))
    if bad or CONFIDENCE_NAMES[0] not in out:
        raise CheckpointError(f"{path}: expected tensors {list(CONFIDENCE_NAMES)}, found {sorted(raw)}")
    return out


def load_confidence_head_(draft, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Attach the draft's confidence head (if needed) and copy ``tensors`` into it; shapes checked."""
    from ..models.dspark_qwen3 import check_confidence_head
    head = draft.confidence_head or draft.add_confidence_head()
    d, r = draft.config.backbone.hidden_size, draft.config.markov_rank
    w = tensors["confidence_head.proj.weight"]
    if tuple(w.shape) != (1, d + r):
        raise CheckpointError(f"tensor 'confidence_head.proj.weight' in {where} has shape "
                              f"{tuple(w.shape)}, expected (1, {d + r}) (hidden {d} + markov rank {r})")
    b = tensors.get("confidence_head.proj.bias")
    if b is None or tuple(b.shape) != (1,):
        raise CheckpointError(f"tensor 'confidence_head.proj.bias' in {where}: "
                              f"{'missing' if b is None else f'shape {tuple(b.shape)}, expected (1,)'}")
    check_confidence_head(head, d, r, True, where)
    with torch.no_grad():
        head.proj.weight.copy_(w)
        head.proj.bias.copy_(b)


def load_qwen3_pair(target_dir: str | Path, draft_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device="cpu", quantization: str | None = None):
    """-> (ModelPair, target module, draft module), weights loaded, eval mode. Target linears the
    checkpoint stores in fp8 (``weight`` + ``weight_scale_inv``, Qwen3-FP8) load as ``Fp8Linear``;
    ``quantization`` (``checkpoints.fp8``) then keeps, quantises or dequantises them."""
    from .fp8 import apply_quantization_, check_quantization, fp8_linear_names
    pair = read_pair_config(target_dir, draft_dir)
    check_quantization(quantization, pair.target.arch)
    target, draft = build_models(pair, dtype=dtype, device=device)
    tied = pair.target.tie_word_embeddings
    fp8_linears_(target, fp8_linear_names(checkpoint_files(target_dir)), quantize=False)
    load_into_module(target, target_dir, skip=lambda n: tied and n == "lm_head.weight")
    apply_quantization_(pair, target, dtype, quantization, loaded=True)
    names = checkpoint_files(draft_dir)
    in_ckpt = any(n.startswith("confidence_head.") for n in names)
    if in_ckpt and draft.confidence_head is None:
        if draft.markov_head is None:
            raise CheckpointError(f"draft {draft_dir} ships confidence_head.* but has no Markov head "
                                  f"(markov_rank 0): the head's input is [h ; W1[x_prev]]")
        draft.add_confidence_head()
    side = None if in_ckpt else read_confidence_side_file(draft_dir)
    dropped = load_into_module(draft, draft_dir, rename=_draft_rename,
                               skip=lambda n: n.split(".")[0] in ("embed_tokens", "lm_head")
                               or (not in_ckpt and n.startswith("confidence_head.")))
    if side is not None:
        load_confidence_head_(draft, side, str(Path(draft_dir) / CONFIDENCE_SIDE_FILE))
    elif not in_ckpt and draft.confidence_head is not None:
        log.info("draft %s enables a confidence head but ships none: loaded without it", draft_dir)
        draft.confidence_head = None
    for name in SHARED:
        if name in dropped:
            want = tuple(getattr(draft, name.split(".")[0]).weight.shape)
            if tuple(dropped[name].shape) != want:
                raise CheckpointError(f"draft tensor '{name}' in {draft_dir} has shape "
                                      f"{tuple(dropped[name].shape)}, target has {want}")
            log.info("draft ships %s; using the target's shared copy", name)
    return pair, target, draft


def qwen3_target_tensors(target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict in the HF naming (fused projections of ``LLM``'s modules split back)."""
    sd = unfused_state_dict(target)
    if target.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def qwen3_draft_tensors(draft: torch.nn.Module, include_shared: bool = True) -> dict[str, torch.Tensor]:
    """State dict in the published draft naming (shared embed/head copies included by default)."""
    return {k: v for k, v in unfused_state_dict(draft).items()
            if include_shared or k.split(".")[0] not in ("embed_tokens", "lm_head")}
