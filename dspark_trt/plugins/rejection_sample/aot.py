"""AOT entry kernel of ``dspark::rejection_sample`` for TensorRT (``plugins/aot.py``: signature from the
op registry, ``compile_ptx``): TensorRT's order, input pointers, int32 scalars, output pointers."""
import triton
import triton.language as tl

from ..kernels.rejection import rejection_sample_kernel


@triton.jit
def rejection_sample_aot(target_logits, draft_tokens, draft_logits, temperature, seed, start, N, V,
                         accepted, next_token, BLOCK_V: tl.constexpr):
    """grid (B,)."""
    rejection_sample_kernel(target_logits, draft_tokens, draft_logits, temperature, seed, start,
                            accepted, next_token, N, V, BLOCK_V)
