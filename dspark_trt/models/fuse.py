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
import torch.nn.functional as F
from torch import Tensor, nn

from ..plugins.decode_linear import decode_linear
from ..plugins.fp8_linear import FP8_BLOCK, fp8_linear_bucketed
from .fp8_linear import Fp8Linear

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
        return self.rows(x).split(self.sizes, -1)

    def rows(self, x: Tensor) -> Tensor:
        """The parts' outputs side by side, one tensor [..., sum(sizes)] (what ``forward`` splits)."""
        return decode_linear(x, self.weight, self.skinny_gemm)

    def parts_from(self, x: Tensor, i: int) -> tuple[Tensor, ...]:
        """The outputs of parts i, i+1, ... only (one GEMM over their rows, a view of the weight)."""
        return self.rows_from(x, i).split(self.sizes[i:], -1)

    def rows_from(self, x: Tensor, i: int) -> Tensor:
        """``parts_from``'s outputs side by side, one tensor [..., sum(sizes[i:])]."""
        return F.linear(x, self.weight[sum(self.sizes[:i]):])


class FusedFp8Linear(FusedLinear):
    """``Fp8Linear``s stacked by output rows, their 128x128 block scales stacked with them: every
    part but the last must have a multiple of 128 rows, so no scale block spans two parts (Qwen3's
    q/k/v and gate/up at every tensor-parallel size up to 8 do)."""

    def __init__(self, linears: list[Fp8Linear]):
        nn.Module.__init__(self)
        self.sizes = [lin.out_features for lin in linears]
        if not _scale_blocks_stack(self.sizes):
            raise ValueError(f"FusedFp8Linear: part rows {self.sizes} are not multiples of {FP8_BLOCK} "
                             f"(a scale block would span two parts)")
        if len({lin.act_quant for lin in linears}) != 1:
            raise ValueError("FusedFp8Linear: parts mix weight-only and W8A8 (act_quant) linears")
        self.act_quant = linears[0].act_quant
        self.in_features, self.out_features = linears[0].in_features, sum(self.sizes)
        self.weight = nn.Parameter(torch.cat([lin.weight for lin in linears], 0), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.cat([lin.weight_scale_inv for lin in linears], 0),
                                             requires_grad=False)
        self.skinny_gemm = False

    _apply = Fp8Linear._apply                   # device moves only: fp8 codes and fp32 scales keep their dtypes

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.parts_from(x, 0)

    def rows(self, x: Tensor) -> Tensor:
        return fp8_linear_bucketed(x, self.weight, self.weight_scale_inv, act_quant=self.act_quant)

    def rows_from(self, x: Tensor, i: int) -> Tensor:
        r = sum(self.sizes[:i])
        return fp8_linear_bucketed(x, self.weight[r:], self.weight_scale_inv[r // FP8_BLOCK:],
                                   act_quant=self.act_quant)


def _plain(*linears) -> bool:
    return all(type(lin) is nn.Linear for lin in linears)


def _scale_blocks_stack(rows: list[int]) -> bool:
    """Whether parts of these row counts stack with their 128x128 scale blocks: no block spans two."""
    return all(n % FP8_BLOCK == 0 for n in rows[:-1])


def _fusable(*linears) -> type | None:
    """The fused class for ``linears``: plain linears, or fp8 ones whose scale blocks stack."""
    if _plain(*linears):
        return FusedLinear
    if all(type(lin) is Fp8Linear for lin in linears) and _scale_blocks_stack([lin.out_features for lin in linears]) \
            and len({lin.act_quant for lin in linears}) == 1:
        return FusedFp8Linear
    return None


def fuse_projections_(module: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every Qwen3 attention and SwiGLU MLP inside ``module`` in place;
    returns the number of fused groups. Calling it again changes nothing. ``Fp8Linear`` groups fuse
    into ``FusedFp8Linear`` where their block scales stack (row counts on the 128 grid); other
    groups, and groups mixing formats, stay unfused."""
    from .layers import SwiGLU
    from .qwen3 import Qwen3Attention
    n = 0
    for m in list(module.modules()):
        if isinstance(m, Qwen3Attention) and m.qkv_proj is None and (
                fused := _fusable(m.q_proj, m.k_proj, m.v_proj)):
            m.qkv_proj = fused([m.q_proj, m.k_proj, m.v_proj])
            m.q_proj = m.k_proj = m.v_proj = None
            n += 1
        elif isinstance(m, SwiGLU) and m.gate_up_proj is None and (fused := _fusable(m.gate_proj, m.up_proj)):
            m.gate_up_proj = fused([m.gate_proj, m.up_proj])
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
    parts' HF names, and an fp8 one's ``weight_scale_inv`` by rows of 128-row scale blocks;
    ``sizes[fused]``: the parts' row counts (views, no copy)."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        owner, _, fused = prefix.rpartition(".")
        if leaf not in ("weight", "weight_scale_inv") or fused not in FUSED_PARTS:
            out[name] = t
            continue
        rows, parts = sizes[fused], FUSED_PARTS[fused]
        if leaf == "weight_scale_inv":
            rows = [-(-r // FP8_BLOCK) for r in rows]
        if sum(rows) != t.shape[0] or len(rows) != len(parts):
            raise ValueError(f"{name}: {t.shape[0]} rows do not split into {dict(zip(parts, rows))}")
        for part, w in zip(parts, t.split(rows, 0)):
            out[f"{owner}.{part}.{leaf}" if owner else f"{part}.{leaf}"] = w
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
            fused = name.rpartition(".")[2]
            keys = [f"{name}.{leaf}" for leaf in ("weight", "weight_scale_inv") if f"{name}.{leaf}" in state]
            state.update(unfuse_state_dict({k: state.pop(k) for k in keys}, {fused: m.sizes}))
    return state
