"""AOT entry kernel of ``dspark::noncausal_swa_indices`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.swa_indices import noncausal_swa_indices_kernel


@triton.jit
def noncausal_swa_indices_aot(start, block_table, P, N, PAGE_SIZE, WINDOW, WIDTH, indices, lens,
                              BLOCK: tl.constexpr):
    """grid (B,)."""
    noncausal_swa_indices_kernel(start, block_table, indices, lens, P, N, PAGE_SIZE, WINDOW, WIDTH, BLOCK)
