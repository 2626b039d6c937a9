"""dspark::moe_experts_mxfp4 — ``dspark::moe_experts`` with the routed experts held in MXFP4.

Weights as the DeepSeek-V4 release stores its routed experts, stacked like ``moe_experts``' w13
(gate rows then up rows) and w2: ``w13_packed [E, 2h, d/2]`` / ``w2_packed [E, d, h/2]`` uint8 (or
int8), two E2M1 codes per byte, low nibble = even input column; ``w13_scale [E, 2h, d/32]`` /
``w2_scale [E, d, h/32]`` uint8 E8M0, one exponent per 32 input columns:
``W[r, c] = e2m1(code[r, c]) * 2^(scale[r, c // 32] - 127)`` (exponent byte 0 reads as 0).

Reference: dequantise the chosen experts' weights to x's dtype (exact for bf16 / fp32: two
significant bits times a power of two), then ``moe_experts``' math and rounding points
(``experts_ref``). The Triton path runs ``moe_experts``' grouped kernels with the MXFP4 weight
format (``kernels/moe.py``): the packed bytes are decoded in registers, so it computes the same
values up to the GEMM summation order and reads only the chosen experts' packed bytes and scales
(~0.53 B per weight against 2 B in bf16). With bf16 / fp16 x the inner product is
``tl.dot_scaled`` by default: on the H200 (Triton 3.6, ``moe-mxfp4-NVIDIA-H200-900325a.json.gz``) it
equals the reference and takes 219 / 1,168 us at V4-Flash shapes for 1 / 16 tokens where the
in-register decode takes 1,063 / 9,920 us (bf16 experts: 155 / 1,090 us).
``DSPARK_MXFP4_DOT_SCALED=0`` (read at import) selects the in-register decode (fp32 x always).
Up to ``moe_decode.DECODE_MAX_PAIRS`` (token, slot) pairs the op runs the GEMV decode schedule
instead (``kernels/moe_decode.py``: E2M1 through fp32 bit patterns, no MMA tiles).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..dispatch import use_triton
from ..moe_experts import check_moe_args, experts_ref
from ..opspec import AotDesc, OnnxNode, OpSpec

MXFP4_GROUP = 32
PACKED_DTYPES = (torch.uint8, torch.int8)
DOT_SCALED = os.environ.get("DSPARK_MXFP4_DOT_SCALED", "1") != "0"


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """packed [..., c/2] uint8 / int8, scale [..., c/32] uint8 E8M0 -> [..., c] in ``dtype`` (fp32
    product, one rounding). E2M1 by integer arithmetic, ``2^(s - 127)`` from the exponent bits."""
    b = packed.view(torch.uint8).to(torch.int32)
    code = torch.stack([b & 15, b >> 4], -1).flatten(-2)                     # [..., c], low nibble first
    ex, man = (code >> 1) & 3, code & 1
    twice = torch.where(ex == 0, man, (2 + man) << (ex - 1).clamp(min=0))     # 2|v|: 0 1 2 3 4 6 8 12
    val = torch.where(code & 8 != 0, -twice, twice).to(torch.float32) * 0.5
    pow2 = (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (val * pow2.repeat_interleave(MXFP4_GROUP, -1)).to(dtype)


def moe_experts_mxfp4_ref(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13_packed: Tensor,
                          w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, first_expert: int,
                          swiglu_limit: float) -> Tensor:
    """x [M, d]; expert_ids [M, k] int (global ids); routing_weights [M, k] f32; w13_packed
    [E, 2h, d/2], w13_scale [E, 2h, d/32]; w2_packed [E, d, h/2], w2_scale [E, d, h/32] -> y [M, d]."""
    return experts_ref(x, expert_ids, routing_weights,
                       lambda e: dequantize_mxfp4(w13_packed[e], w13_scale[e], x.dtype),    # [M, k, 2h, d]
                       lambda e: dequantize_mxfp4(w2_packed[e], w2_scale[e], x.dtype),      # [M, k, d, h]
                       w13_packed.shape[0], first_expert, swiglu_limit)


def check_mxfp4_args(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13_packed: Tensor,
                     w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor) -> None:
    """Raise ValueError naming the argument that does not fit."""
    op = "dspark::moe_experts_mxfp4"
    for name, t in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
        if t.dtype not in PACKED_DTYPES or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D uint8 / int8 (E2M1 pairs), got {t.dtype} {tuple(t.shape)}")
    check_moe_args(x, expert_ids, routing_weights, w13_packed, w2_packed, "moe_experts_mxfp4", pack=2)
    E, h2, _ = w13_packed.shape
    d = x.shape[1]
    if d % MXFP4_GROUP or (h2 // 2) % MXFP4_GROUP:
        raise ValueError(f"{op}: hidden size d={d} and intermediate size h={h2 // 2} must be multiples of "
                         f"{MXFP4_GROUP} (one E8M0 scale per {MXFP4_GROUP} columns)")
    for name, t, want in (("w13_scale", w13_scale, (E, h2, d // MXFP4_GROUP)),
                          ("w2_scale", w2_scale, (E, d, h2 // 2 // MXFP4_GROUP))):
        if t.dtype != torch.uint8 or tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} is {t.dtype} {tuple(t.shape)}, expected uint8 E8M0 {want}")


@torch.library.triton_op("dspark::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13_packed: Tensor,
                      w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, first_expert: int,
                      swiglu_limit: float) -> Tensor:
    check_mxfp4_args(x, expert_ids, routing_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    args = (x, expert_ids, routing_weights, w13_packed, w13_scale, w2_packed, w2_scale, first_expert, swiglu_limit)
    if use_triton(x):
        from ..kernels.moe import moe_experts_mxfp4_triton
        return moe_experts_mxfp4_triton(*args, dot_scaled=DOT_SCALED and x.dtype in (torch.bfloat16, torch.float16))
    return moe_experts_mxfp4_ref(*args)


OPS = (
    OpSpec("moe_experts_mxfp4", moe_experts_mxfp4_ref, triton="kernels.moe:moe_experts_mxfp4_triton",
           onnx=OnnxNode((("x", "T"), ("expert_ids", "I"), ("routing_weights", "F"), ("w13_packed", "U8"),
                          ("w13_scale", "U8"), ("w2_packed", "U8"), ("w2_scale", "U8")),
                         (("out", "T"),), {"first_expert": "int", "swiglu_limit": "float"}),
           aot=AotDesc(("T", torch.int64, torch.float32, torch.uint8, torch.uint8, torch.uint8, torch.uint8),
                       ("FIRST_EXPERT", "E", "D", "H", "K"), ("T",),
                       {"LIMIT": 10.0, "BLOCK_D": 128, "BLOCK_H": 32, "BLOCK_K": 128}, num_warps=4),
           tensorrt=True, export_safe=True),
)
