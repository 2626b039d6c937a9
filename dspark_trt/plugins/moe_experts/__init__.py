"""dspark::moe_experts — the routed experts of a mixture-of-experts layer, chosen experts only.

For token m: ``y[m] = Σ_j W2_e (silu(min(g, L)) * clamp(u, -L, L) * w[m, j])`` over its k slots j
with ``e = expert_ids[m, j] - first_expert`` inside ``[0, E)`` (a slot with id -1, or an expert
held by another expert-parallel rank, is skipped), ``[g; u] = W13_e x[m]`` (w13 holds the gate rows
then the up rows), ``L = swiglu_limit`` (no clamp when L <= 0). Rounding points follow the eager
``v4_moe.Expert``: g and u come out of a matmul in x's dtype, the activation and routing weight
are fp32, the activation is rounded to x's dtype before W2, each slot's output is in x's dtype, and
the k slot outputs are summed in fp32 (slot order) and rounded once.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dispatch import use_triton
from ..expert_ids import local_experts
from ..opspec import AotDesc, OnnxNode, OpSpec


def moe_experts_ref(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: Tensor, w2: Tensor,
                    first_expert: int, swiglu_limit: float) -> Tensor:
    """x [M, d]; expert_ids [M, k] int (global ids); routing_weights [M, k] f32;
    w13 [E, 2h, d]; w2 [E, d, h] -> y [M, d]."""
    return experts_ref(x, expert_ids, routing_weights, lambda e: w13[e], lambda e: w2[e], w13.shape[0],
                       first_expert, swiglu_limit)


def experts_ref(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13_of: Callable[[Tensor], Tensor],
                w2_of: Callable[[Tensor], Tensor], num_experts: int, first_expert: int,
                swiglu_limit: float) -> Tensor:
    """The reference math over gathered weights: ``w13_of(e)`` / ``w2_of(e)`` map local expert ids
    e [M, k] to their weights in x's dtype, [M, k, 2h, d] / [M, k, d, h]."""
    acc = torch.promote_types(x.dtype, torch.float32)
    local, live = local_experts(expert_ids, first_expert, num_experts)           # [M, k]
    e = torch.where(live, local, 0)
    w13 = w13_of(e)
    h = w13.shape[-2] // 2
    gu = (w13 @ x[:, None, :, None]).squeeze(-1).to(acc)                        # [M, k, 2h]
    gate, up = gu[..., :h], gu[..., h:]
    if swiglu_limit > 0:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    act = (F.silu(gate) * up * routing_weights.to(acc)[..., None]).to(x.dtype)   # [M, k, h]
    out = (w2_of(e) @ act[..., None]).squeeze(-1)                               # [M, k, d]
    return torch.where(live[..., None], out.to(acc), 0.0).sum(1).to(x.dtype)


def check_moe_args(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: Tensor, w2: Tensor,
                   op: str = "moe_experts", pack: int = 1) -> None:
    """Raise ValueError naming the argument whose shape does not fit (``pack`` logical columns per
    stored one: 2 for MXFP4's nibble pairs)."""
    M, d = x.shape
    E, h2, d13 = w13.shape
    per = f"/{pack}" if pack > 1 else ""
    h = h2 // 2
    problems = [(expert_ids.dim() != 2 or expert_ids.shape[0] != M, f"expert_ids {tuple(expert_ids.shape)} is not [M={M}, k]"),
                (routing_weights.shape != expert_ids.shape,
                 f"routing_weights {tuple(routing_weights.shape)} != expert_ids {tuple(expert_ids.shape)}"),
                (d13 * pack != d or h2 % 2, f"w13 {tuple(w13.shape)} is not [E, 2h, d{per}={d // pack}]"),
                (tuple(w2.shape) != (E, d, h // pack), f"w2 {tuple(w2.shape)} is not [E={E}, d={d}, h{per}={h // pack}]"),
                (expert_ids.dtype not in (torch.int32, torch.int64), f"expert_ids dtype {expert_ids.dtype} is not int")]
    for bad, msg in problems:
        if bad:
            raise ValueError(f"dspark::{op}: {msg}")


@torch.library.triton_op("dspark::moe_experts", mutates_args=())
def moe_experts(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: Tensor, w2: Tensor,
                first_expert: int, swiglu_limit: float) -> Tensor:
    check_moe_args(x, expert_ids, routing_weights, w13, w2)
    if use_triton(x):
        from ..kernels.moe import moe_experts_triton
        return moe_experts_triton(x, expert_ids, routing_weights, w13, w2, first_expert, swiglu_limit)
    return moe_experts_ref(x, expert_ids, routing_weights, w13, w2, first_expert, swiglu_limit)


OPS = (
    OpSpec("moe_experts", moe_experts_ref, triton="kernels.moe:moe_experts_triton",
           onnx=OnnxNode((("x", "T"), ("expert_ids", "I"), ("routing_weights", "F"), ("w13", "T"), ("w2", "T")),
                         (("out", "T"),), {"first_expert": "int", "swiglu_limit": "float"}),
           aot=AotDesc(("T", torch.int64, torch.float32, "T", "T"), ("FIRST_EXPERT", "E", "D", "H", "K"), ("T",),
                       {"LIMIT": 10.0, "BLOCK_D": 128, "BLOCK_H": 32, "BLOCK_K": 128}, num_warps=4),
           tensorrt=True, export_safe=True),
)
