"""Where a result came from: git sha (or $DSPARK_GIT_SHA where the tree has no .git, e.g. a copy
sent to a GPU machine), library versions, GPU name."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_sha() -> str:
    if os.environ.get("DSPARK_GIT_SHA"):
        return os.environ["DSPARK_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "nogit"


def versions() -> dict:
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "tensorrt", "transformers", "onnx"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            pass
    return v


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def result_path(out_dir: str | Path, name: str, gpu: str, tag: str = "") -> Path:
    """``<out_dir>/<name>-[<tag>-]<gpu>-<sha>.json`` (the directory made): where a benchmark's
    JSON goes, named by what ran it and where."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}-{tag + '-' if tag else ''}{gpu.replace(' ', '-')}-{git_sha()}.json"
