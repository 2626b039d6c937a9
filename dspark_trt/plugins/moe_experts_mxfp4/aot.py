"""AOT entry kernel of ``dspark::moe_experts_mxfp4`` for TensorRT (``plugins/aot.py``): TensorRT's
order, input pointers, int32 scalars, output pointers; ``moe_experts``' token schedule with the
MXFP4 weight format."""
import triton
import triton.language as tl

from ..kernels.moe import MXFP4, moe_experts_token_kernel


@triton.jit
def moe_experts_mxfp4_aot(x, expert_ids, routing_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                          FIRST_EXPERT, E, D, H, K, out, LIMIT: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """grid (M, cdiv(D, BLOCK_D)); H is the logical intermediate size (2 x w2_packed's last dim)."""
    moe_experts_token_kernel(x, expert_ids, routing_weights, w13_packed, w13_scale, w2_packed, w2_scale, out,
                             FIRST_EXPERT, E, D, H, K, LIMIT, MXFP4, BLOCK_D, BLOCK_H, BLOCK_K)
