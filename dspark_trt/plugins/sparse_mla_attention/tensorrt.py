"""TensorRT plugin descriptors of ``dspark::sparse_mla_attention`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt.plugin as trtp

from ..aot import AOT_KERNELS
from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


# --- sparse_mla_attention --------------------------------------------------------------------
@trtp.register(f"{NS}::sparse_mla_attention")
def sparse_mla_attention_desc(q: trtp.TensorDesc, kv: trtp.TensorDesc, indices: trtp.TensorDesc,
                              attn_sink: trtp.TensorDesc, scale: float, dv: int) -> trtp.TensorDesc:
    T, H = q.shape_expr[0], q.shape_expr[1]
    return trtp.from_shape_expr((T, H, dv), dtype=q.dtype)


@trtp.autotune(f"{NS}::sparse_mla_attention")
def sparse_mla_attention_tune(q, kv, indices, attn_sink, scale, dv, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, {_FLOAT}, INT32, FP32, {_FLOAT}")]


@trtp.aot_impl(f"{NS}::sparse_mla_attention")
def sparse_mla_attention_aot(q: trtp.TensorDesc, kv: trtp.TensorDesc, indices: trtp.TensorDesc,
                             attn_sink: trtp.TensorDesc, scale: float, dv: int,
                             outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    D = q.shape_expr[2]
    if not D.is_constant:
        raise ValueError("sparse_mla_attention: the latent dim must be static")
    block_h = AOT_KERNELS["sparse_mla_attention"].constants["BLOCK_H"]
    name, ptx, lp = _ptx("sparse_mla_attention", q.dtype, SCALE=float(scale), D=D.constant_value(),
                         DV=int(dv))
    lp.grid_x, lp.grid_y = q.shape_expr[0], trtp.cdiv(q.shape_expr[1], block_h)
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(indices.shape_expr[1]),
                                         trtp.SymInt32(q.shape_expr[1])])
    return name, ptx, lp, extra
