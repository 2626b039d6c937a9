"""TensorRT plugin descriptors of ``dspark::block_attention`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt.plugin as trtp

from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


# --- block_attention -------------------------------------------------------------------------
@trtp.register(f"{NS}::block_attention")
def block_attention_desc(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                         block_table: trtp.TensorDesc, positions: trtp.TensorDesc,
                         kv_limit: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
    return q.like()


@trtp.autotune(f"{NS}::block_attention")
def block_attention_tune(q, k_cache, v_cache, block_table, positions, kv_limit, scale, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, {_FLOAT}, {_FLOAT}, INT64, INT64, INT64, {_FLOAT}")]


@trtp.aot_impl(f"{NS}::block_attention")
def block_attention_aot(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                        block_table: trtp.TensorDesc, positions: trtp.TensorDesc,
                        kv_limit: trtp.TensorDesc, scale: float, outputs: Tuple[trtp.TensorDesc],
                        tactic: int) -> AotResult:
    H, D = q.shape_expr[2], q.shape_expr[3]
    Hkv = k_cache.shape_expr[2]
    if not (H.is_constant and D.is_constant and Hkv.is_constant):
        raise ValueError("block_attention: heads and head dim must be static")
    G = H.constant_value() // Hkv.constant_value()
    block_t = max(1, 32 // G)
    name, ptx, lp = _ptx("block_attention", q.dtype, SCALE=float(scale), H=H.constant_value(),
                         HKV=Hkv.constant_value(), D=D.constant_value(), BLOCK_T=block_t)
    lp.grid_x, lp.grid_y = q.shape_expr[0], Hkv
    lp.grid_z = trtp.cdiv(q.shape_expr[1], block_t)
    extra = trtp.SymIntExprs.from_tuple([
        trtp.SymInt32(q.shape_expr[1]), trtp.SymInt32(block_table.shape_expr[1]),
        trtp.SymInt32(k_cache.shape_expr[1]), trtp.SymInt32(k_cache.shape_expr[0] - 1)])
    return name, ptx, lp, extra
