"""AOT entry kernel of ``dspark::markov_sample`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.markov_exact import markov_rows_kernel


@triton.jit
def markov_sample_aot(U, anchor, w1, w2, temperature, seed, start, B, N, V, R, tokens, z,
                      BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """grid (cdiv(B, BLOCK_B),): ``markov_rows_kernel``, the one-launch schedule that needs no
    zeroed workspace (a TensorRT AOT plugin has none), at the cost of one SM per row group."""
    markov_rows_kernel(U, anchor, w1, w2, temperature, seed, start, z, tokens, B, N, V, R, N * V, V,
                       BLOCK_B, BLOCK_V, BLOCK_R)
