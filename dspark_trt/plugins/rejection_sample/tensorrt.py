"""TensorRT plugin descriptors of ``dspark::rejection_sample`` (register / autotune / aot_impl).

Imported by ``tensorrt_plugins.py`` (the TensorRT guard; its docstring says how they work)."""
from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

from ..tensorrt_common import AotResult, NS, _FLOAT, _ptx


# --- rejection_sample ------------------------------------------------------------------------
@trtp.register(f"{NS}::rejection_sample")
def rejection_sample_desc(target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                          draft_logits: trtp.TensorDesc, temperature: trtp.TensorDesc,
                          seed: trtp.TensorDesc, start: trtp.TensorDesc
                          ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    B = target_logits.shape_expr[0]
    return trtp.from_shape_expr((B,), dtype=trt.int64), trtp.from_shape_expr((B,), dtype=trt.int64)


@trtp.autotune(f"{NS}::rejection_sample")
def rejection_sample_tune(target_logits, draft_tokens, draft_logits, temperature, seed, start, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, INT64, FP32, FP32, INT64, INT64, INT64, INT64")]


@trtp.aot_impl(f"{NS}::rejection_sample")
def rejection_sample_aot(target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                         draft_logits: trtp.TensorDesc, temperature: trtp.TensorDesc,
                         seed: trtp.TensorDesc, start: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc],
                         tactic: int) -> AotResult:
    name, ptx, lp = _ptx("rejection_sample", target_logits.dtype)
    L = target_logits.shape_expr
    lp.grid_x = L[0]
    return name, ptx, lp, trtp.SymIntExprs.from_tuple([trtp.SymInt32(L[1] - 1), trtp.SymInt32(L[2])])
