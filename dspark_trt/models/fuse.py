"""Fused input projections for compiled engines: one GEMM for q/k/v, one for gate/up.

At batch 1 a decode step is a chain of GEMVs. Merging the three attention projections and the two
MLP input projections reads the same bytes in fewer, larger kernels (vLLM's QKVParallelLinear and
MergedColumnParallelLinear do the same). The builder applies this after the weights are loaded (and
after tensor-parallel sharding, so each rank fuses its own slices); checkpoints keep their HF names.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
import torch.nn.functional as F


class FusedLinear(nn.Module):
    """Bias-free linears stacked by output rows: ``x -> (x W_0^T, x W_1^T, ...)``."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinear stacks bias-free linears only")
        self.sizes = [lin.out_features for lin in linears]
        self.weight = nn.Parameter(torch.cat([lin.weight for lin in linears], 0), requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, -1)

    def rows_from(self, i: int) -> Tensor:
        """The stacked weight of parts i, i+1, ... (a view: no copy)."""
        return self.weight[sum(self.sizes[:i]):]


def _plain(*linears) -> bool:
    return all(type(lin) is nn.Linear for lin in linears)


def fuse_projections_(module: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every Qwen3 attention and SwiGLU MLP inside ``module`` in place;
    returns the number of fused groups. Calling it again changes nothing. Groups holding a non-plain
    linear (``Fp8Linear``: its block scales do not stack for row counts off the 128 grid) stay
    unfused."""
    from .layers import SwiGLU
    from .qwen3 import Qwen3Attention
    n = 0
    for m in list(module.modules()):
        if isinstance(m, Qwen3Attention) and m.qkv_proj is None and _plain(m.q_proj, m.k_proj, m.v_proj):
            m.qkv_proj = FusedLinear([m.q_proj, m.k_proj, m.v_proj])
            m.q_proj = m.k_proj = m.v_proj = None
            n += 1
        elif isinstance(m, SwiGLU) and m.gate_up_proj is None and _plain(m.gate_proj, m.up_proj):
            m.gate_up_proj = FusedLinear([m.gate_proj, m.up_proj])
            m.gate_proj = m.up_proj = None
            n += 1
    return n
