"""TensorRT plugin descriptors (``tensorrt.plugin``, "quickly deployable plugins") of the dspark ops.

Import this module before parsing an ONNX model with ``dspark`` nodes: each ``@trtp.register``
defines ``trtp.op.dspark.<name>`` (output shapes/dtypes), each ``@trtp.aot_impl`` hands TensorRT
the PTX of the op's AOT entry kernel (``aot.py``: same Triton kernel as the torch op), so the plan
runs without Python. Attributes are not serialized into AOT plans: they are baked into the PTX
(constexprs) or passed as ``SymInt32`` constants. Importing without TensorRT raises ImportError
(the guard); nothing else in the package imports this module.

Limitations: ``markov_sample`` uses the row-group schedule (one program per <= 16 rows runs all N
steps; a grid-wide split needs a zeroed workspace that AOT plugins do not get); the fast
``markov_sample_topk`` is two kernels and has no TensorRT plugin; ``moe_experts`` runs the
per-token schedule (no workspace for the expert grouping, so each token reads its experts' w13
once per output tile: correct, not fast).
"""
from __future__ import annotations

from typing import Tuple, Union

import tensorrt as trt             # noqa: F401  (ImportError here is the guard)
import tensorrt.plugin as trtp
import torch

from .aot import AOT_KERNELS, compile_ptx
from .registry import OPS

NS = "dspark"
_TORCH = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16}
_FLOAT = "FP32|FP16|BF16"
AotResult = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]


def _ptx(name: str, dtype, **constants):
    kname, ptx, md = compile_ptx(name, _TORCH[dtype], **constants)
    lp = trtp.KernelLaunchParams()
    lp.block_x = md.num_warps * 32
    lp.shared_mem = md.shared
    return kname.encode(), ptx.encode(), lp


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


# --- noncausal_swa_indices -------------------------------------------------------------------
@trtp.register(f"{NS}::noncausal_swa_indices")
def noncausal_swa_indices_desc(start: trtp.TensorDesc, block_table: trtp.TensorDesc, num_queries: int,
                               page_size: int, window: int, width: int
                               ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    from .noncausal_swa_indices import check_width
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


# --- moe_experts -----------------------------------------------------------------------------
@trtp.register(f"{NS}::moe_experts")
def moe_experts_desc(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, routing_weights: trtp.TensorDesc,
                     w13: trtp.TensorDesc, w2: trtp.TensorDesc, first_expert: int,
                     swiglu_limit: float) -> trtp.TensorDesc:
    return x.like()


@trtp.autotune(f"{NS}::moe_experts")
def moe_experts_tune(x, expert_ids, routing_weights, w13, w2, first_expert, swiglu_limit, outputs):
    return [trtp.AutoTuneCombination(f"{_FLOAT}, INT64, FP32, {_FLOAT}, {_FLOAT}, {_FLOAT}")]


@trtp.aot_impl(f"{NS}::moe_experts")
def moe_experts_aot(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, routing_weights: trtp.TensorDesc,
                    w13: trtp.TensorDesc, w2: trtp.TensorDesc, first_expert: int, swiglu_limit: float,
                    outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
    block_d = AOT_KERNELS["moe_experts"].constants["BLOCK_D"]
    name, ptx, lp = _ptx("moe_experts", x.dtype, LIMIT=float(swiglu_limit))
    lp.grid_x, lp.grid_y = x.shape_expr[0], trtp.cdiv(x.shape_expr[1], block_d)
    E, H = w13.shape_expr[0], w2.shape_expr[2]
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(first_expert), trtp.SymInt32(E),
                                         trtp.SymInt32(x.shape_expr[1]), trtp.SymInt32(H),
                                         trtp.SymInt32(expert_ids.shape_expr[1])])
    return name, ptx, lp, extra


# the ops with a TensorRT plugin (registry flag ``tensorrt``; their descriptors are above)
PLUGINS = tuple(name for name, op in OPS.items() if op.tensorrt)
