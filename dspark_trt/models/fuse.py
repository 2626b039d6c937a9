"""Fused input projections: one GEMM for q/k/v, one for gate/up (engines and ``LLM``'s modules).

At batch 1 a decode step is a chain of GEMVs. Merging the three attention projections and the two
MLP input projections reads the same bytes in fewer, larger kernels (vLLM's QKVParallelLinear and
MergedColumnParallelLinear do the same). ``checkpoints.prepare_models`` applies this after the
weights are loaded (and after tensor-parallel sharding, so each rank fuses its own slices), for the
builder and for ``LLM.from_preset`` / ``from_checkpoints``; checkpoints keep their HF names
(``unfused_state_dict`` / ``unfuse_state_dict`` split a fused weight back into them).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..plugins.decode_linear import decode_linear

# fused module name -> the HF names of its parts, in row order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class FusedLinear(nn.Module):
    """Bias-free linears stacked by output rows: ``x -> (x W_0^T, x W_1^T, ...)``."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinear stacks bias-free linears only")
        self.sizes = [lin.out_features for lin in linears]
        self.weight = nn.Parameter(torch.cat([lin.weight for lin in linears], 0), requires_grad=False)
        self.skinny_gemm: bool | None = False   # decode_linear's ``enabled`` (None: DSPARK_SKINNY_GEMM)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return decode_linear(x, self.weight, self.skinny_gemm).split(self.sizes, -1)

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


def use_skinny_gemm_fused_(module: nn.Module) -> int:
    """Let every ``FusedLinear`` in ``module`` run ``plugins.decode_linear`` as ``DSPARK_SKINNY_GEMM``
    says (what ``plugins.decode_linear.use_decode_linear_`` does for plain linears); returns how many."""
    fused = [m for m in module.modules() if isinstance(m, FusedLinear)]
    for m in fused:
        m.skinny_gemm = None
    return len(fused)


def unfuse_state_dict(state: dict[str, Tensor], sizes: dict[str, list[int]]) -> dict[str, Tensor]:
    """``state`` with every ``<prefix>.<fused>.weight`` (``FUSED_PARTS``) split by rows into its
    parts' HF names; ``sizes[fused]``: the parts' row counts (views, no copy)."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        owner, _, fused = prefix.rpartition(".")
        if leaf != "weight" or fused not in FUSED_PARTS:
            out[name] = t
            continue
        rows, parts = sizes[fused], FUSED_PARTS[fused]
        if sum(rows) != t.shape[0] or len(rows) != len(parts):
            raise ValueError(f"{name}: {t.shape[0]} rows do not split into {dict(zip(parts, rows))}")
        for part, w in zip(parts, t.split(rows, 0)):
            out[f"{owner}.{part}.weight" if owner else f"{part}.weight"] = w
    return out


def qwen3_fused_sizes(cfg) -> dict[str, list[int]]:
    """Rows of the fused parts of a (one-rank) Qwen3 layer with config ``cfg``."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}


def unfused_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` in the HF names, fused projections split back (equal tensors)."""
    state = module.state_dict()
    for name, m in module.named_modules():
        if isinstance(m, FusedLinear):
            key = f"{name}.weight"
            fused = name.rpartition(".")[2]
            state.update(unfuse_state_dict({key: state.pop(key)}, {fused: m.sizes}))
    return state
