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
