"""``Fp8Linear``: a bias-free linear whose weight stays in fp8 e4m3 with 128x128 block scales
(``dspark::fp8_linear``), and the swaps between it and ``nn.Linear``.

Parameter names are the checkpoints' (``<prefix>.weight`` fp8 ``[N, K]``,
``<prefix>.weight_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]``), so an FP8 checkpoint loads
into it as is. ``module.to(dtype)`` moves it between devices but never changes its dtypes (a cast
of the fp8 codes without their scales would be wrong, and bf16 scales would lose precision).

Which linears are quantised: ``FP8_PROJECTIONS`` (attention q/k/v/o and MLP gate/up/down), as the
published Qwen3-FP8 checkpoints do; embeddings, norms and lm_head stay in the model dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..plugins.fp8_linear import FP8_DTYPE, dequantize_fp8, fp8_linear_bucketed, quantize_fp8, scale_shape

FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Fp8Linear(nn.Module):
    """``y = x @ (weight * weight_scale_inv per block)^T`` in x's dtype."""

    def __init__(self, in_features: int, out_features: int, device=None, act_quant: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_quant = act_quant      # W8A8: x quantised per (token, 128-column group) to fp8 as well
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(scale_shape(out_features, in_features),
                                                        dtype=torch.float32, device=device), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Quantise a bias-free linear (scale = block amax / 448)."""
        if linear.bias is not None:
            raise ValueError("Fp8Linear: bias is not supported")
        m = cls(linear.in_features, linear.out_features, device=linear.weight.device)
        q, s = quantize_fp8(linear.weight.detach())
        with torch.no_grad():
            m.weight.copy_(q)
            m.weight_scale_inv.copy_(s)
        return m

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        """The ``nn.Linear`` (in ``dtype``) holding ``weight * scale`` rounded once."""
        lin = nn.Linear(self.in_features, self.out_features, bias=False, device=self.weight.device, dtype=dtype)
        lin.weight = nn.Parameter(dequantize_fp8(self.weight, self.weight_scale_inv, dtype), requires_grad=False)
        return lin

    def _apply(self, fn, recurse=True):
        """Device moves only: ``fn`` is probed on an empty tensor for the device it sends to."""
        for name, p in list(self._parameters.items()):
            dev = fn(torch.empty(0, dtype=p.dtype, device=p.device)).device
            if dev != p.device:
                self._parameters[name] = nn.Parameter(p.data.to(dev), requires_grad=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear_bucketed(x, self.weight, self.weight_scale_inv, act_quant=self.act_quant)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"
                + (", activations fp8 per 128-group" if self.act_quant else ""))


def _swap(module: nn.Module, want: Callable[[str, nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> int:
    n = 0
    for prefix, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if want(full, child):
                setattr(parent, name, make(child))
                n += 1
    return n


def is_fp8_projection(name: str, child: nn.Module) -> bool:
    return type(child) is nn.Linear and child.bias is None and name.rsplit(".", 1)[-1] in FP8_PROJECTIONS


def fp8_linears_(module: nn.Module, names: set[str] | None = None, quantize: bool = True) -> int:
    """Replace bias-free ``nn.Linear`` children by ``Fp8Linear`` in place: those whose full name is in
    ``names`` (None: every ``FP8_PROJECTIONS`` linear). ``quantize``: quantise the current weights
    (random init, a bf16 checkpoint); else empty fp8 modules for a checkpoint to fill. Returns the
    number replaced."""
    want = (lambda n, c: type(c) is nn.Linear and c.bias is None and n in names) if names is not None \
        else is_fp8_projection
    make = Fp8Linear.from_linear if quantize else \
        (lambda c: Fp8Linear(c.in_features, c.out_features, device=c.weight.device))
    return _swap(module, want, make)


def dequantize_fp8_linears_(module: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``Fp8Linear`` inside ``module`` by its dequantised ``nn.Linear`` in ``dtype``."""
    return _swap(module, lambda n, c: isinstance(c, Fp8Linear), lambda c: c.dequantized(dtype))
