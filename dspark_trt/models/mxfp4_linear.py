"""``Mxfp4Linear``: a bias-free linear whose weight stays in MXFP4, for DeepSeek-V4's routed experts
(``--quantization fp8``), and the swaps between it and ``nn.Linear``.

Buffer names are the checkpoint's (``checkpoints/v4.py`` aliases ``.scale`` to ``.weight_scale``
for fp4 experts): ``weight [out, in/2]`` uint8, two E2M1 codes per byte (low nibble = even input
index), ``weight_scale [out, in/32]`` uint8 E8M0. Integer buffers, so ``module.to(dtype)`` leaves
them alone. ``MoE.stack_experts_`` stacks them into ``dspark::moe_experts_mxfp4``'s layout; an
unstacked one runs the dequantise + matmul reference.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..plugins.moe_experts_mxfp4 import MXFP4_GROUP, dequantize_mxfp4
from .fp8_linear import _swap

# (packed [out, in/2] uint8, E8M0 scale [out, in/32] uint8) of a float weight [out, in]
Quantizer = Callable[[Tensor], tuple[Tensor, Tensor]]


class Mxfp4Linear(nn.Module):
    """``y = x @ W^T``, ``W[r, c] = e2m1(weight nibble) * 2^(weight_scale[r, c // 32] - 127)``."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        if in_features % MXFP4_GROUP:
            raise ValueError(f"Mxfp4Linear: in_features = {in_features} is not a multiple of {MXFP4_GROUP}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.full((out_features, in_features // MXFP4_GROUP), 127,
                                                        dtype=torch.uint8, device=device))

    @classmethod
    def from_parts(cls, packed: Tensor, scale: Tensor) -> "Mxfp4Linear":
        """Around packed [out, in/2] and scale [out, in/32] (viewed as uint8, not copied)."""
        m = cls(packed.shape[1] * 2, packed.shape[0], device="meta")
        m.weight, m.weight_scale = packed.view(torch.uint8), scale.view(torch.uint8)
        return m

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=False, device=self.weight.device, dtype=dtype)
        lin.weight = nn.Parameter(dequantize_mxfp4(self.weight, self.weight_scale, dtype), requires_grad=False)
        return lin

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, dequantize_mxfp4(self.weight, self.weight_scale, x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, MXFP4 e2m1 + e8m0 per 32"


def is_routed_expert_linear(name: str, child: nn.Module) -> bool:
    """``....experts.<j>.w1 / w2 / w3`` plain linears (not the shared expert's)."""
    parts = name.split(".")
    return (type(child) is nn.Linear and child.bias is None and len(parts) >= 3 and parts[-3] == "experts"
            and parts[-1] in ("w1", "w2", "w3"))


def mxfp4_experts_(module: nn.Module, quantize: Quantizer | None = None) -> int:
    """Replace the routed experts' ``nn.Linear`` inside ``module`` by ``Mxfp4Linear``: quantised
    with ``quantize`` (random weights), or empty for a checkpoint to fill. Returns how many."""
    if quantize is None:
        make = lambda c: Mxfp4Linear(c.in_features, c.out_features, device=c.weight.device)  # noqa: E731
    else:
        make = lambda c: Mxfp4Linear.from_parts(*quantize(c.weight.detach()))               # noqa: E731
    return _swap(module, is_routed_expert_linear, make)


def dequantize_mxfp4_linears_(module: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``Mxfp4Linear`` inside ``module`` by its dequantised ``nn.Linear`` in ``dtype``."""
    return _swap(module, lambda n, c: isinstance(c, Mxfp4Linear), lambda c: c.dequantized(dtype))
