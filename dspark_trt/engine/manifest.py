"""Engine directory format: manifest.json + compiled networks + weights (+ tokenizer files).

An engine directory is complete or absent: ``output_dir.atomic_engine_dir`` writes it into a
temporary sibling directory and renames it into place as the last step (and never replaces a
directory that is not an engine). ``check_engine`` refuses, with a message saying how to
rebuild, an engine of another format version, with a missing or corrupted file, or built for
another GPU, backend version or torch version.

Two files are the engine's settings rather than its build, and commands replace them in place
after it: the confidence calibration (``dspark-trt calibrate --engine``) and the scheduler's cost
curve (``dspark-trt bench --cost-curve --engine``). They are ``SIDECAR_FILES``: written whole or not
at all (``atomic_write``), checked by their own loaders (``ConfidenceFileError`` names the file and
field), and neither listed in the manifest nor checksummed against it, so replacing one does not
make the engine "corrupted".
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# replaced in place after a build (see above): checkpoints.files' CALIBRATION_FILE and COST_FILE, named
# here since the engine format imports nothing of checkpoints (a test keeps the two equal)
SIDECAR_FILES = frozenset({"confidence_calibration.json", "verify_cost.json"})


class EngineError(ValueError):
    """An engine directory cannot be used; the message names the problem and how to rebuild."""


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def device_info(device: torch.device) -> dict:
    """What an engine is tied to: "cpu", or the GPU name and compute capability."""
    if device.type != "cuda":
        return {"type": "cpu"}
    idx = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    return {"type": "cuda", "name": torch.cuda.get_device_name(idx), "capability": f"{major}.{minor}"}


def toolchain_versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "tensorrt"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:                    # not installed (or broken): recorded as absent
            out[mod] = None
    return out


def write_manifest(engine_dir: Path, manifest: dict) -> dict:
    """Add format version and per-file SHA-256 of everything in ``engine_dir`` but its
    ``SIDECAR_FILES``; write it."""
    files = sorted(p for p in engine_dir.rglob("*")
                   if p.is_file() and p.name != MANIFEST and str(p.relative_to(engine_dir)) not in SIDECAR_FILES)
    manifest = {"format_version": FORMAT_VERSION, **manifest,
                "files": {str(p.relative_to(engine_dir)): {"sha256": sha256(p), "bytes": p.stat().st_size}
                          for p in files}}
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def read_manifest(engine_dir: str | Path) -> dict:
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise EngineError(f"{engine_dir}: engine directory does not exist (build it with `dspark-trt build`)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: missing; {engine_dir} is not a complete engine "
                          f"(rebuild with `dspark-trt build`)") from None
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e}); rebuild the engine") from None


def rebuild_hint(manifest: dict) -> str:
    cmd = manifest.get("build_command")
    return f"rebuild it with: {cmd}" if cmd else "rebuild it with `dspark-trt build`"


def check_engine(engine_dir: str | Path, device: torch.device, verify_checksums: bool = True,
                 rank: int | None = None) -> dict:
    """Read and validate the manifest against the files and this machine; return it. ``rank``:
    of a tensor-parallel engine, check the shared files and only this rank's ``rank<r>/`` part
    (each rank reads only its own; a node may hold only the parts of its ranks)."""
    engine_dir = Path(engine_dir)
    m = read_manifest(engine_dir)
    hint = rebuild_hint(m)
    if m.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{engine_dir}: engine format version {m.get('format_version')!r}, this "
                          f"dspark_trt reads version {FORMAT_VERSION}; {hint}")
    for name, info in m.get("files", {}).items():
        if name in SIDECAR_FILES or rank is not None and rank_of_file(name) not in (None, rank):
            continue                  # (engines before SIDECAR_FILES listed the calibration)
        path = engine_dir / name
        if not path.is_file():
            raise EngineError(f"{engine_dir}: file '{name}' listed in the manifest is missing; {hint}")
        if path.stat().st_size != info["bytes"] or (verify_checksums and sha256(path) != info["sha256"]):
            raise EngineError(f"{engine_dir}: file '{name}' is corrupted (SHA-256 differs from the "
                              f"manifest); {hint}")
    built, here = m["device"], device_info(device)
    if built["type"] != here["type"]:
        raise EngineError(f"{engine_dir}: engine was built for {built['type']}, loading on "
                          f"{here['type']}; {hint} --device {here['type']}")
    if built["type"] == "cuda" and built["capability"] != here["capability"]:
        raise EngineError(f"{engine_dir}: engine was built for {built['name']} (compute capability "
                          f"{built['capability']}), this GPU is {here['name']} ({here['capability']}); {hint}")
    backend, versions = m["backend"], m["versions"]
    if backend == "aoti" and versions["torch"] != torch.__version__:
        raise EngineError(f"{engine_dir}: AOTInductor engine built with torch {versions['torch']}, "
                          f"running torch {torch.__version__}; {hint}")
    if backend == "tensorrt":
        trt = toolchain_versions()["tensorrt"]
        if trt != versions.get("tensorrt"):
            raise EngineError(f"{engine_dir}: TensorRT engine built with TensorRT "
                              f"{versions.get('tensorrt')}, this machine has {trt}; {hint}")
    return m


def rank_of_file(name: str) -> int | None:
    """The rank whose part holds the manifest file ``name`` (``rank3/weights.safetensors`` -> 3;
    None: a file every rank shares)."""
    top = name.split("/", 1)[0]
    digits = top.removeprefix("rank")
    return int(digits) if "/" in name and top.startswith("rank") and digits.isdigit() else None


# ---- configs in the manifest ---------------------------------------------------------------------

def config_to_json(cfg) -> dict:
    """A config dataclass -> {"class": "module:Name", "fields": {...}} (nested dataclasses too)."""
    import dataclasses
    fields = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        fields[f.name] = config_to_json(v) if dataclasses.is_dataclass(v) else v
    return {"class": f"{type(cfg).__module__}:{type(cfg).__qualname__}", "fields": fields}


def config_from_json(d: dict):
    import importlib
    mod, name = d["class"].split(":")
    cls = getattr(importlib.import_module(mod), name)
    return cls(**{k: config_from_json(v) if isinstance(v, dict) and "class" in v and "fields" in v else v
                  for k, v in d["fields"].items()})
