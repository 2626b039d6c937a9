"""TensorRT plugin descriptors of ``dspark::noncausal_swa_indices`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

from ..tensorrt_common import AotResult, NS, _ptx


# --- noncausal_swa_indices -------------------------------------------------------------------
@trtp.register(f"{NS}::noncausal_swa_indices")
def noncausal_swa_indices_desc(start: trtp.TensorDesc, block_table: trtp.TensorDesc, num_queries: int,
                               page_size: int, window: int, width: int
                               ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    from . import check_width
    check_width(window, num_queries, width)
    B = start.shape_expr[0]
    return (trtp.from_shape_expr((B, num_queries, width), dtype=trt.int32),
            trtp.from_shape_expr((B, num_queries), dtype=trt.int32))


@trtp.autotune(f"{NS}::noncausal_swa_indices")
def noncausal_swa_indices_tune(start, block_table, num_queries, page_size, window, width, outputs):
    return [trtp.AutoTuneCombination("INT64, INT64, INT32, INT32")]


@trtp.aot_impl(f"{NS}::noncausal_swa_indices")
def noncausal_swa_indices_aot(start: trtp.TensorDesc, block_table: trtp.TensorDesc, num_queries: int,
                              page_size: int, window: int, width: int,
                              outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    name, ptx, lp = _ptx("noncausal_swa_indices", trt.float32)
    lp.grid_x = start.shape_expr[0]
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(block_table.shape_expr[1]),
                                         trtp.SymInt32(num_queries), trtp.SymInt32(page_size),
                                         trtp.SymInt32(window), trtp.SymInt32(width)])
    return name, ptx, lp, extra
