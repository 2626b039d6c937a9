"""Row-wise kernels of the eager bf16 Qwen3 layers on steps wider than the decode chain (issue #21):
verifies of many rows, draft blocks of big batches, prefills.

Under CUDA graphs an eager layer's cost past the GEMMs is its elementwise kernels: ``RMSNorm`` is
nine (upcast, square, mean, add, rsqrt, two products, the weight's cast, the downcast), the
residual add before it one more, ``F.silu(gate) * up`` two. On an H100 at Qwen3-8B dims the target's
forward over 128 rows (a batch-16 verify) took the eager modules 12.70 ms, with these kernels 7.70
(59677c4; the compiled modules 7.78 at f9411cd). Here each is one launch, with the modules' roundings:

    add_rmsnorm(x, r, w)  -> (bf16(h * rsqrt(mean(h^2) + eps) * w), h),  h = bf16(x + r) (x without r)
    silu_mul(gu)          -> bf16(bf16(silu(gate)) * up)                  of fused rows [gate | up]

(the fp32 mean sums in another order than torch's, so a normed value may round the other way once
in a while). The q / k norms, RoPE and the cache write go through ``qk_rope_cache`` (one launch for
any number of tokens). ``models.qwen3.use_row_kernels_`` switches a target's layers to them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, round_bf16, swiglu_bf16

MAX_NORM_WIDTH = 16384        # one program holds a row


@triton.jit
def add_rmsnorm_kernel(x, r, w, y, s, N, eps, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    h = tl.load(x + row * N + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_R:
        h = round_bf16(h + tl.load(r + row * N + cols, mask=m, other=0.0).to(tl.float32))
        tl.store(s + row * N + cols, h.to(tl.bfloat16), mask=m)
    rs = tl.rsqrt((tl.sum(h * h, 0) / N + eps).to(tl.float32))
    wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * N + cols, round_bf16(h * rs * wv).to(tl.bfloat16), mask=m)


@triton.jit
def silu_mul_kernel(gu, out, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)         # BLOCK divides K
    tl.store(out + row * K + offs, swiglu_bf16(gu + row * 2 * K, K, offs).to(tl.bfloat16))


def _bf16_rows(name: str, *tensors: Tensor) -> None:
    bad = [t.dtype for t in tensors if t.dtype != torch.bfloat16]
    if bad:
        raise ValueError(f"{name}: bfloat16 inputs only (it rounds as the bf16 modules do), got {bad[0]}")


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [..., N] (+ residual, same shape) -> (normed [..., N], the sum [..., N]; x itself without
    ``residual``), bf16, one launch."""
    _bf16_rows("add_rmsnorm", x, weight, *(() if residual is None else (residual,)))
    N = x.shape[-1]
    if weight.numel() != N or N > MAX_NORM_WIDTH or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rmsnorm: rows of {N} (at most {MAX_NORM_WIDTH}), weight {tuple(weight.shape)}, "
                         f"residual {None if residual is None else tuple(residual.shape)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    rows = x.numel() // N
    if rows:
        block = triton.next_power_of_2(N)
        launcher(add_rmsnorm_kernel)[(rows,)](
            x, x if residual is None else residual.contiguous(), weight.contiguous(), y, s, N, float(eps),
            HAS_R=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return y, s


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2K] (fused rows [gate | up]) -> bf16(bf16(silu(gate)) * up) [..., K], one launch."""
    _bf16_rows("silu_mul", gate_up)
    K = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], K)
    rows = gate_up.numel() // (2 * K) if K else 0
    if rows:
        block = min(1024, K & -K)                  # the largest power of two dividing K, at most 1024
        launcher(silu_mul_kernel)[(rows, K // block)](gate_up, out, K, BLOCK=block,
                                                      num_warps=max(1, min(8, block // 128)))
    return out
