"""AOT entry kernel of ``dspark::block_attention`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.block_attention import block_attention_kernel


@triton.jit
def block_attention_aot(q, k_cache, v_cache, block_table, positions, kv_limit, T, P, PAGE_SIZE, PAD_PAGE,
                        out, SCALE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """grid (B, Hkv, cdiv(T, BLOCK_T))."""
    block_attention_kernel(q, k_cache, v_cache, block_table, positions, kv_limit, out, SCALE, T, P,
                           PAGE_SIZE, PAD_PAGE, H, HKV, D, BLOCK_T, BLOCK_N, PREFETCH)
