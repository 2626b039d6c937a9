"""Device names from users (``--device``, ``device=``): checked before anything loads."""
from __future__ import annotations

import torch

from .config import ConfigError


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` (None: cuda when available, else cpu) as a ``torch.device``; ``ConfigError``
    (a ``ValueError``) when it is not cpu / cuda[:N] or names a GPU this machine lacks."""
    if device is None:
        return torch.device(default_device())
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
    if d.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: only cpu and cuda are supported")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ConfigError(f"device {str(device)!r}: CUDA is not available ({why}); use cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")
    return d


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's native bf16 instruction sets (AMX-BF16, AVX512-BF16) from ``/proc/cpuinfo``
    (``torch.backends.cpu.get_cpu_capability()`` says "AVX512" either way); [] when unknown."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]
