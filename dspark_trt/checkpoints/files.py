"""HF-format checkpoint directories: read and write safetensors (single file or index + shards).

Errors name the tensor and the file. Loading checks the whole state dict before anything is copied
into a module, so a bad checkpoint never leaves a half-loaded model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..progress import bar

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# beside a draft with a confidence head (``dspark-trt calibrate``), copied into its engines
CALIBRATION_FILE = "confidence_calibration.json"
# the scheduler's measured cost curve (``dspark-trt bench --cost-curve``), beside a draft or in an engine
COST_FILE = "verify_cost.json"


def draft_sidecar(name: str, draft=None) -> str:
    """The name of a sidecar file (CALIBRATION_FILE, COST_FILE) beside ``draft``'s checkpoint: a
    draft over a draft vocabulary (``models/draft_vocab.py``) accepts differently and has a cheaper
    draft step, so its calibration and cost curve have names of their own,
    ``<stem>.vocab-<size>-<ids hash>.json``, never found by runs without the set (or with another);
    engines keep the plain names (their set is compiled in)."""
    vocab = getattr(draft, "draft_vocab", None)
    return name if vocab is None else name.replace(".json", f".vocab-{vocab.key}.json")


def sidecar_mismatch(directory, name: str, draft=None) -> str | None:
    """Why a draft over a draft vocabulary gets no ``name`` sidecar from ``directory``: the message
    when its own file is missing but one made without the set is there, else None."""
    own, d = draft_sidecar(name, draft), Path(directory)
    if own == name or (d / own).is_file() or not (d / name).is_file():
        return None
    return (f"{d / name} was made without this draft vocabulary: not used (its own is {own}: "
            "`dspark-trt calibrate` / `bench --cost-curve` with --draft-vocab write it)")


def calibration_file(draft=None) -> str:
    return draft_sidecar(CALIBRATION_FILE, draft)


def cost_file(draft=None) -> str:
    return draft_sidecar(COST_FILE, draft)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not match the model; the message names the tensor."""


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """tensor name -> file that holds it (from the index, or the single file's header)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory does not exist")
    if (d / INDEX).exists():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{d / INDEX}: not a valid safetensors index ({e})") from None
        files = {name: d / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"{f}: shard listed in {INDEX} is missing")
        return files
    if (d / SINGLE).exists():
        return {name: d / SINGLE for name in _names(d / SINGLE)}
    raise CheckpointError(f"{d}: neither {SINGLE} nor {INDEX} found")


def _names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def read_tensors(ckpt_dir: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Read tensors (all, or ``names``) from a checkpoint directory."""
    files = checkpoint_files(ckpt_dir)
    wanted = list(files) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        if n not in files:
            raise CheckpointError(f"tensor '{n}' is missing from checkpoint {ckpt_dir}")
        by_file.setdefault(files[n], []).append(n)
    out = {}
    progress = bar(total=len(wanted), desc=f"loading {Path(ckpt_dir).name}", unit="tensor")
    for path, ns in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
                    progress.update()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor(s) {ns[:3]}... ({e})") from None
    progress.close()
    return out


def write_checkpoint(ckpt_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                     max_shard_bytes: int | None = None, extra_files: dict[str, str] | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (or shards with an index)."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(d / SINGLE), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for k, v in tensors.items():
            nbytes = v.numel() * v.element_size()
            if cur and size + nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = v, size + nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(d / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                           "weight_map": weight_map}, indent=2))
    for name, text in (extra_files or {}).items():
        (d / name).write_text(text)


def check_finite(t: torch.Tensor, what: str, chunk: int = 1 << 24) -> None:
    """Raise ``CheckpointError`` naming ``what`` if the float tensor ``t`` holds NaN or Inf (one
    ``isfinite`` pass, in chunks so the mask stays small; 1-byte floats are checked as fp32)."""
    if not t.is_floating_point():
        return
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i:i + chunk]
        part = part.float() if part.element_size() == 1 else part
        ok = torch.isfinite(part)
        if not bool(ok.all()):
            first = i + int((~ok).nonzero()[0, 0])
            raise CheckpointError(f"tensor {what} holds non-finite values (NaN or Inf; the first at "
                                  f"flat index {first}): the checkpoint is corrupt, nothing was loaded")


def load_into_module(module: torch.nn.Module, ckpt_dir: str | Path,
                     rename: Callable[[str], str | None] = lambda n: n,
                     skip: Callable[[str], bool] = lambda n: False,
                     expect_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Load a checkpoint into ``module``'s parameters, all-or-nothing.

    ``rename`` maps checkpoint names to module names (None drops the tensor); ``skip(module_name)``
    marks module parameters that the checkpoint need not provide (e.g. shared embeddings).
    Returns the dropped tensors by checkpoint name. Raises ``CheckpointError`` naming the tensor and
    file for a missing, unexpected, mis-shaped or wrongly typed tensor, or one holding NaN / Inf.
    """
    files = checkpoint_files(ckpt_dir)
    params = dict(module.named_parameters(remove_duplicate=False))
    mapping, dropped_names = {}, []
    for name in files:
        target = rename(name)
        if target is None:
            dropped_names.append(name)
        elif target not in params:
            raise CheckpointError(f"unexpected tensor '{name}' in {files[name]} "
                                  f"(no parameter '{target}' in {type(module).__name__})")
        else:
            mapping[target] = name
    missing = [p for p in params if p not in mapping and not skip(p)]
    if missing:
        raise CheckpointError(f"tensor for parameter '{missing[0]}' is missing from checkpoint "
                              f"{ckpt_dir} ({len(missing)} missing in all)")
    tensors = read_tensors(ckpt_dir, list(mapping.values()) + dropped_names)
    for pname, cname in mapping.items():
        t, p = tensors[cname], params[pname]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor '{cname}' in {files[cname]} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(p.shape)}")
        if expect_dtype is not None and t.dtype != expect_dtype:
            raise CheckpointError(f"tensor '{cname}' in {files[cname]} has dtype {t.dtype}, "
                                  f"expected {expect_dtype}")
        if not t.is_floating_point():
            raise CheckpointError(f"tensor '{cname}' in {files[cname]} has non-float dtype {t.dtype}")
        if (p.dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
            raise CheckpointError(f"tensor '{cname}' in {files[cname]} has dtype {t.dtype}, expected "
                                  f"{p.dtype} (fp8 weights load only with their weight_scale_inv, "
                                  "into fp8 linears)")
        check_finite(t, f"'{cname}' in {files[cname]}")
    with torch.no_grad():
        for pname, cname in mapping.items():
            params[pname].copy_(tensors[cname])
    return {n: tensors[n] for n in dropped_names}
