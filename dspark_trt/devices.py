"""Device names from users (``--device``, ``device=``): checked before anything loads; the default
dtype of a device; a GPU's HBM bandwidth for rooflines."""
from __future__ import annotations

import torch

from .config import ConfigError
from .config.dtypes import AUTO, DTYPE_CHOICES, DTYPES


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


# bf16 on a CPU with native bf16 (AMX / AVX512-BF16) is faster, but measured on the default pair
# (2-core AVX512-BF16 CPU, #18): greedy speculative output differed from greedy plain decoding on
# 3 of 3 prompts within 128 tokens (bf16 near-ties: fp32 top-2 margins 0.08-0.14 at logits
# 14-20, where one bf16 step is 0.125), so the CPU default stays fp32 and bf16 is opt-in.
CPU_BF16_DEFAULT = False


def default_dtype(device: str, flags: list[str] | None = None) -> torch.dtype:
    """bf16 on CUDA; on a CPU fp32, or bf16 where the CPU has native bf16 (``flags``: its bf16
    instruction sets, default: read from /proc/cpuinfo) and ``CPU_BF16_DEFAULT`` is on."""
    if device.startswith("cuda"):
        return torch.bfloat16
    flags = cpu_bf16_flags() if flags is None else flags
    return torch.bfloat16 if flags and CPU_BF16_DEFAULT else torch.float32


def cpu_dtype_note(dtype: torch.dtype, flags: list[str] | None = None) -> str | None:
    """One line saying which dtype a CPU run uses by default and why, on a CPU with native bf16
    (None elsewhere: fp32 needs no word)."""
    flags = cpu_bf16_flags() if flags is None else flags
    if not flags:
        return None
    if dtype == torch.bfloat16:
        return f"[dspark-trt] CPU has native bf16 ({', '.join(flags)}): using bf16 (--dtype fp32 for fp32)"
    return (f"[dspark-trt] CPU has native bf16 ({', '.join(flags)}) but fp32 is the default: in "
            "bf16, greedy speculative output can differ from plain decoding on near-ties "
            "(--dtype bf16 for speed)")


LOW_PRECISION = (torch.bfloat16, torch.float16)


def resolve_dtype(dtype, device: str, stored: torch.dtype | None = None) -> tuple[torch.dtype, str | None]:
    """(the dtype to run in, a one-line note or None) for ``dtype`` on ``device``: a torch dtype or
    a ``DTYPES`` name wins; None / "auto" is the checkpoint's ``stored`` dtype, or the device's
    ``default_dtype`` for random weights (``stored`` None). On a CPU a bf16 / fp16 checkpoint runs
    in ``default_dtype("cpu")`` (fp32: bf16 GEMMs here are not batch-invariant, see
    ``CPU_BF16_DEFAULT``), and the note says which dtype a CPU run uses and why."""
    if isinstance(dtype, torch.dtype):
        return dtype, None
    if dtype is not None and dtype != AUTO:
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} (--dtype): choose one of {', '.join(DTYPE_CHOICES)}")
        return DTYPES[dtype], None
    if not device.startswith("cpu"):
        return stored or default_dtype(device), None
    chosen = default_dtype(device)
    if stored is not None and stored not in LOW_PRECISION:
        chosen = stored                                      # fp32 / fp64 checkpoints as stored
    note = cpu_dtype_note(chosen)
    if note is None and stored in LOW_PRECISION and chosen != stored:
        note = (f"[dspark-trt] the checkpoint is {str(stored).removeprefix('torch.')}; running "
                f"{str(chosen).removeprefix('torch.')} on the CPU: in bf16, greedy speculative output "
                "can differ from plain decoding on near-ties (--dtype bf16 for speed)")
    return chosen, note


# Peak HBM bandwidth by GPU name (bytes/s, the vendor's figure); the first key the name contains.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                   "A100-SXM4-80GB": 2.039e12, "A100 80GB": 1.935e12, "A100": 1.555e12}
DEFAULT_HBM_BYTES_PER_S = 4.8e12          # the H200's: what the project's numbers are quoted against


def hbm_bytes_per_s(name: str | None = None) -> float:
    """The peak HBM bandwidth of the GPU called ``name`` (None: the current CUDA device's; a GPU
    not in ``HBM_BYTES_PER_S`` or none at all: ``DEFAULT_HBM_BYTES_PER_S``)."""
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((b for k, b in HBM_BYTES_PER_S.items() if k in name), DEFAULT_HBM_BYTES_PER_S)
