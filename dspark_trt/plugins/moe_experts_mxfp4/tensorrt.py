"""TensorRT plugin descriptors of ``dspark::moe_experts_mxfp4`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt.plugin as trtp

from ..aot import AOT_KERNELS
from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


@trtp.register(f"{NS}::moe_experts_mxfp4")
def moe_experts_mxfp4_desc(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, routing_weights: trtp.TensorDesc,
                           w13_packed: trtp.TensorDesc, w13_scale: trtp.TensorDesc, w2_packed: trtp.TensorDesc,
                           w2_scale: trtp.TensorDesc, first_expert: int, swiglu_limit: float) -> trtp.TensorDesc:
    return x.like()


@trtp.autotune(f"{NS}::moe_experts_mxfp4")
def moe_experts_mxfp4_tune(x, expert_ids, routing_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                           first_expert, swiglu_limit, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, INT64, FP32, UINT8, UINT8, UINT8, UINT8, {_FLOAT}")]


@trtp.aot_impl(f"{NS}::moe_experts_mxfp4")
def moe_experts_mxfp4_aot(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, routing_weights: trtp.TensorDesc,
                          w13_packed: trtp.TensorDesc, w13_scale: trtp.TensorDesc, w2_packed: trtp.TensorDesc,
                          w2_scale: trtp.TensorDesc, first_expert: int, swiglu_limit: float,
                          outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    block_d = AOT_KERNELS["moe_experts_mxfp4"].constants["BLOCK_D"]
    name, ptx, lp = _ptx("moe_experts_mxfp4", x.dtype, LIMIT=float(swiglu_limit))
    lp.grid_x, lp.grid_y = x.shape_expr[0], trtp.cdiv(x.shape_expr[1], block_d)
    E, H = w13_packed.shape_expr[0], w2_packed.shape_expr[2] * 2
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(first_expert), trtp.SymInt32(E),
                                         trtp.SymInt32(x.shape_expr[1]), trtp.SymInt32(H),
                                         trtp.SymInt32(expert_ids.shape_expr[1])])
    return name, ptx, lp, extra
