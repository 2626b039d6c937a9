"""AOT entry kernel of ``dspark::sparse_mla_attention`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.sparse_mla import sparse_mla_attention_kernel


@triton.jit
def sparse_mla_attention_aot(q, kv, indices, attn_sink, W, H, out, SCALE: tl.constexpr,
                             D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_SCAN: tl.constexpr, PREFETCH: tl.constexpr):
    """grid (T, cdiv(H, BLOCK_H)): whole index lists, all DV value dims per program."""
    sparse_mla_attention_kernel(q, kv, indices, attn_sink, out, SCALE, W, H, D, DV, BLOCK_H, BLOCK_N, DV, BLOCK_SCAN,
                                PREFETCH)
