"""AOT entry kernel of ``dspark::kv_cache_write`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.kv_cache import kv_cache_write_kernel


@triton.jit
def kv_cache_write_aot(k_cache, v_cache, k, v, block_table, positions, T, P, PAGE_SIZE, ROW,
                       k_cache_out, v_cache_out, BLOCK: tl.constexpr):
    """Outputs alias the cache inputs (in place); grid (B * T,)."""
    kv_cache_write_kernel(k_cache_out, v_cache_out, k, v, block_table, positions, T, P, PAGE_SIZE, ROW,
                          BLOCK)
