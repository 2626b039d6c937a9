"""TensorRT plugin descriptors of ``dspark::kv_cache_write`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt.plugin as trtp

from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


# --- kv_cache_write (in place: outputs alias the cache inputs) --------------------------------
@trtp.register(f"{NS}::kv_cache_write")
def kv_cache_write_desc(k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc, k: trtp.TensorDesc,
                        v: trtp.TensorDesc, block_table: trtp.TensorDesc,
                        positions: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return k_cache.aliased(), v_cache.aliased()


@trtp.autotune(f"{NS}::kv_cache_write")
def kv_cache_write_tune(k_cache, v_cache, k, v, block_table, positions, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, {_FLOAT}, {_FLOAT}, {_FLOAT}, INT64, INT64, {_FLOAT}, {_FLOAT}")]


@trtp.aot_impl(f"{NS}::kv_cache_write")
def kv_cache_write_aot(k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc, k: trtp.TensorDesc,
                       v: trtp.TensorDesc, block_table: trtp.TensorDesc, positions: trtp.TensorDesc,
                       outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    name, ptx, lp = _ptx("kv_cache_write", k_cache.dtype)
    lp.grid_x = positions.shape_expr.numel()
    row = k.shape_expr[2] * k.shape_expr[3]
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(positions.shape_expr[1]),
                                         trtp.SymInt32(block_table.shape_expr[1]),
                                         trtp.SymInt32(k_cache.shape_expr[1]), trtp.SymInt32(row)])
    return name, ptx, lp, extra
