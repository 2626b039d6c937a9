"""``decode_linear(x, w)``: ``F.linear(x, w)`` that runs the skinny-GEMM Triton kernel
(``kernels/skinny_gemm.py``) where an H200 measurement says it beats cuBLAS (issue #21).

Off by default: the kernel is used only when ``DSPARK_SKINNY_GEMM=1`` (read at call time) or
``enabled=True`` is passed, the tensors are CUDA bf16, there are at most ``MAX_M`` rows, and
``kernels.skinny_gemm.TRITON_WINS`` holds True for (M bucket, N, K) (the H200 measurement: M = 1
for most Qwen3-8B shapes, the lm_head up to 64 rows). No bias (Qwen3 has none).
``LLM`` swaps its eager modules' linears for ``DecodeLinear`` when the variable is set
(``use_decode_linear_``); under ``LLM(compile=True)`` the kernel call stays an eager island in the
compiled regions. ``DSPARK_SKINNY_GEMM_TABLE=<skinny_gemm_bench.py JSON>`` replaces the built-in
table by a measurement (e.g. of this GPU). Compiled engines keep cuBLAS (the kernel is not an
exportable op yet).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import HAVE_TRITON

MAX_M = 64
ENV = "DSPARK_SKINNY_GEMM"
TABLE_ENV = "DSPARK_SKINNY_GEMM_TABLE"      # a skinny_gemm_bench.py JSON replacing the built-in table
_loaded_table: list[str] = []


def skinny_gemm_enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def _table():
    """kernels.skinny_gemm with ``DSPARK_SKINNY_GEMM_TABLE``'s measurement loaded (once per path)."""
    from .kernels import skinny_gemm
    path = os.environ.get(TABLE_ENV)
    if path and path not in _loaded_table:
        skinny_gemm.load_table(path)
        _loaded_table[:] = [path]
    return skinny_gemm


def use_skinny_gemm(M: int, N: int, K: int, x: Tensor, w: Tensor, enabled: bool | None = None) -> bool:
    """True when ``decode_linear`` would run the Triton kernel for this call."""
    if not (enabled if enabled is not None else skinny_gemm_enabled()):
        return False
    if not (HAVE_TRITON and x.is_cuda and w.is_cuda and x.dtype == w.dtype == torch.bfloat16 and 0 < M <= MAX_M):
        return False
    sg = _table()
    return bool(sg.TRITON_WINS.get((sg.m_bucket(M), N, K), False))


@torch.compiler.disable
def _skinny(x: Tensor, w: Tensor) -> Tensor:
    """The kernel call, an eager island under torch.compile (its launch parameters are chosen from
    the concrete row count, which a dynamic-shape trace would have to guard on)."""
    K, N = x.shape[-1], w.shape[0]
    return _table().skinny_gemm(x.reshape(-1, K), w).view(*x.shape[:-1], N)


def decode_linear(x: Tensor, w: Tensor, enabled: bool | None = None) -> Tensor:
    """``x[..., K] @ w[N, K]^T`` (``F.linear`` without bias)."""
    K = x.shape[-1]
    N = w.shape[0]
    M = x.numel() // K if K else 0
    if not use_skinny_gemm(M, N, K, x, w, enabled):
        return F.linear(x, w)
    return _skinny(x, w)


class DecodeLinear(nn.Module):
    """Bias-free ``nn.Linear`` stand-in whose forward is ``decode_linear`` (shares the weight)."""

    def __init__(self, weight: Tensor | nn.Parameter, enabled: bool | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.enabled = enabled

    @classmethod
    def from_linear(cls, linear: nn.Linear, enabled: bool | None = None) -> "DecodeLinear":
        if linear.bias is not None:
            raise ValueError("DecodeLinear: bias is not supported")
        return cls(linear.weight, enabled)

    def forward(self, x: Tensor) -> Tensor:
        return decode_linear(x, self.weight, self.enabled)


def use_decode_linear_(module: nn.Module) -> int:
    """Replace every bias-free ``nn.Linear`` inside ``module`` by a ``DecodeLinear`` sharing its
    weight (in place); returns how many were replaced."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, DecodeLinear.from_linear(child))
                n += 1
    return n
