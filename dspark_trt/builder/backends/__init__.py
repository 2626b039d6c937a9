"""Compilation backends: ``aoti`` (torch.export + AOTInductor .pt2) and ``tensorrt`` (ONNX -> plan)."""
from __future__ import annotations

import importlib.util


class BuildError(RuntimeError):
    """A build step failed; the message names the step and what to change."""


def tensorrt_available() -> tuple[bool, str]:
    """(importable, why) for the TensorRT builder."""
    if importlib.util.find_spec("tensorrt") is None:
        return False, "the 'tensorrt' package is not installed"
    try:
        import tensorrt  # noqa: F401
    except Exception as e:                  # bindings present but libnvinfer missing, etc.
        return False, f"'import tensorrt' fails ({e})"
    return True, f"tensorrt {tensorrt.__version__} is importable"


def pick_backend(requested: str) -> tuple[str, str]:
    """'auto' | 'aoti' | 'tensorrt' -> (backend, reason)."""
    ok, why = tensorrt_available()
    if requested == "auto":
        return ("tensorrt", f"auto: {why}") if ok else ("aoti", f"auto: {why}, using AOTInductor")
    if requested == "tensorrt" and not ok:
        raise BuildError(f"--backend tensorrt: {why} (install TensorRT from "
                         "https://pypi.nvidia.com or use --backend aoti)")
    if requested not in ("aoti", "tensorrt"):
        raise BuildError(f"unknown backend '{requested}' (choose auto, aoti or tensorrt)")
    return requested, "requested"
