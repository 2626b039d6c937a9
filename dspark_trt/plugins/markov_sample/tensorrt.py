"""TensorRT plugin descriptors of ``dspark::markov_sample`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

from ..aot import AOT_KERNELS
from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


# --- markov_sample ---------------------------------------------------------------------------
@trtp.register(f"{NS}::markov_sample")
def markov_sample_desc(base_logits: trtp.TensorDesc, anchor: trtp.TensorDesc, w1: trtp.TensorDesc,
                       w2: trtp.TensorDesc, temperature: trtp.TensorDesc, seed: trtp.TensorDesc,
                       start: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    B, N = base_logits.shape_expr[0], base_logits.shape_expr[1]
    return (trtp.from_shape_expr((B, N), dtype=trt.int64),
            trtp.from_shape_expr(base_logits.shape_expr, dtype=trt.float32))


@trtp.autotune(f"{NS}::markov_sample")
def markov_sample_tune(base_logits, anchor, w1, w2, temperature, seed, start, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, INT64, {_FLOAT}, {_FLOAT}, FP32, INT64, INT64, INT64, FP32")]


@trtp.aot_impl(f"{NS}::markov_sample")
def markov_sample_aot(base_logits: trtp.TensorDesc, anchor: trtp.TensorDesc, w1: trtp.TensorDesc,
                      w2: trtp.TensorDesc, temperature: trtp.TensorDesc, seed: trtp.TensorDesc,
                      start: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    block_b = AOT_KERNELS["markov_sample"].constants["BLOCK_B"]
    name, ptx, lp = _ptx("markov_sample", w2.dtype)
    U = base_logits.shape_expr
    lp.grid_x = trtp.cdiv(U[0], block_b)
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(U[0]), trtp.SymInt32(U[1]), trtp.SymInt32(U[2]),
                                         trtp.SymInt32(w1.shape_expr[1])])
    return name, ptx, lp, extra
