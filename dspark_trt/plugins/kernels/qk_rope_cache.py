"""The attention input of decode tokens after the fused q/k/v GEMV: per-head q / k RMSNorm, neox
RoPE and the paged K/V write in one launch, with optional programmatic dependent launch (issue
#21; the layer chain of ``runtime/token_step.py``).

Qwen3's ``queries_and_cache`` is five elementwise kernels (two norms, two RoPEs, the cache write)
between the q/k/v GEMV and the attention; at decode sizes each costs a launch and a gap. Here,
for each of the M tokens (``B`` rows of ``T`` tokens, row-major; token t belongs to row t // T),
program ``(t, h < H)`` takes its query head h and program ``(t, H + j)`` its key head j (and value
head j), with the modules' roundings: ``RMSNorm`` (fp32 ``x * rsqrt(mean(x^2) + eps) * w``, one
rounding to bf16), then ``apply_rope_neox`` (``x * cos`` and ``rotate_half(x) * sin`` each
rounded to bf16, then their sum). ``cos`` / ``sin`` are the tokens' ``rope_cos_sin`` rows [M, D]
(computed once per step, shared by every layer). With ``PDL`` the norm weights, cos / sin, the
positions and the block table, which no kernel of the chain writes, load before ``gdc_wait``.

A token at a negative position, or whose page is missing, writes nothing to the cache (its q is
still computed, as the modules do).

(Session 31 let these programs bulk-prefetch the layer's o weight into L2 after their wait; on an
H100 it cost the AR step 1.2-1.8 ms, token-step-NVIDIA-H100-80GB-HBM3-f354b4b.json.gz, likely
because 40 programs of a short kernel the chain waits for issued every copy. Removed in session 32.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import gdc_launch_dependents, gdc_wait, launcher, pdl_launch, round_bf16


@triton.jit
def _norm_rope(x_lo, x_hi, w_lo, w_hi, c_lo, c_hi, s_lo, s_hi, eps, D: tl.constexpr):
    """A head's halves (fp32 of bf16 values) -> its normed, roped halves (bf16 values in fp32)."""
    r = tl.rsqrt(((tl.sum(x_lo * x_lo, 0) + tl.sum(x_hi * x_hi, 0)) / D + eps).to(tl.float32))
    lo = round_bf16(x_lo * r * w_lo)
    hi = round_bf16(x_hi * r * w_hi)
    out_lo = round_bf16(round_bf16(lo * c_lo) + round_bf16(-hi * s_lo))
    out_hi = round_bf16(round_bf16(hi * c_hi) + round_bf16(lo * s_hi))
    return out_lo, out_hi


@triton.jit
def qk_rope_cache_kernel(qkv, q_out, q_norm, k_norm, cos, sin, k_cache, v_cache, block_table, positions,
                         T, P, PAGE_SIZE, eps, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (M, H + HKV). qkv [M, (H + 2 HKV) D] (q heads, k heads, v heads), q_out [M, H, D],
    norms [D], cos / sin [M, D], caches [pages, PAGE_SIZE, HKV, D], block_table [M // T, P],
    positions [M]."""
    tok = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    half = tl.arange(0, D // 2)
    is_q = pid < H
    w = tl.where(is_q, q_norm, k_norm)                   # the head's norm weight (scalar pointer)
    w_lo = tl.load(w + half).to(tl.float32)
    w_hi = tl.load(w + D // 2 + half).to(tl.float32)
    c_lo = tl.load(cos + tok * D + half).to(tl.float32)
    c_hi = tl.load(cos + tok * D + D // 2 + half).to(tl.float32)
    s_lo = tl.load(sin + tok * D + half).to(tl.float32)
    s_hi = tl.load(sin + tok * D + D // 2 + half).to(tl.float32)
    pos = tl.load(positions + tok)                       # the step's inputs: read before the wait too
    j = pid - H                                          # a k program's KV head
    col = tl.minimum(tl.maximum(pos, 0) // PAGE_SIZE, P - 1)
    page = tl.load(block_table + (tok // T) * P + col)
    ok = (pos >= 0) & (page >= 0) & (pos < P * PAGE_SIZE)
    dst = ((tl.maximum(page, 0) * PAGE_SIZE + tl.maximum(pos, 0) % PAGE_SIZE).to(tl.int64) * HKV + j) * D
    if PDL:
        gdc_wait()
    qkv += tok * (H + 2 * HKV) * D
    src = pid * D                                        # q head h at h * D; k head j at (H + j) * D
    x_lo = tl.load(qkv + src + half).to(tl.float32)
    x_hi = tl.load(qkv + src + D // 2 + half).to(tl.float32)
    lo, hi = _norm_rope(x_lo, x_hi, w_lo, w_hi, c_lo, c_hi, s_lo, s_hi, eps, D)
    if is_q:
        q_row = q_out + (tok * H + pid) * D
        tl.store(q_row + half, lo.to(q_out.dtype.element_ty))
        tl.store(q_row + D // 2 + half, hi.to(q_out.dtype.element_ty))
    else:
        m = half < tl.where(ok, D // 2, 0)                 # inert: every store masked off
        tl.store(k_cache + dst + half, lo.to(k_cache.dtype.element_ty), mask=m)
        tl.store(k_cache + dst + D // 2 + half, hi.to(k_cache.dtype.element_ty), mask=m)
        v_src = (H + HKV + j) * D
        for c in tl.static_range(2):
            v = tl.load(qkv + v_src + c * (D // 2) + half)
            tl.store(v_cache + dst + c * (D // 2) + half, v.to(v_cache.dtype.element_ty), mask=m)


def qk_rope_cache(qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                  v_cache: Tensor, block_table: Tensor, positions: Tensor, heads: int, eps: float,
                  out: Tensor | None = None, pdl: bool = False) -> Tensor:
    """M decode tokens, B rows of T: ``qkv`` [M, (H + 2 Hkv) D] bf16 (the fused projection's
    output) -> normed, roped queries ``out`` [M, H, D]; the normed, roped K and the V of each token
    go into the paged caches [pages, page_size, Hkv, D] at ``positions`` [M] (int64; negative:
    nothing written) through its row of ``block_table`` [B, P]. ``cos`` / ``sin`` [M, D]:
    ``rope_cos_sin`` at those positions (bf16). One token: qkv [(H + 2 Hkv) D], block_table [P].
    ``heads`` 0: the K / V write alone (the draft's context: ``Qwen3Attention.context_cache``,
    which passes the k norm as ``q_norm`` too), an empty ``out``."""
    Hkv, D = int(k_cache.shape[2]), int(k_cache.shape[3])
    H = int(heads)
    bad = [n for n, t in (("qkv", qkv), ("q_norm", q_norm), ("k_norm", k_norm), ("cos", cos), ("sin", sin))
           if t.dtype != torch.bfloat16]
    if bad:
        raise ValueError(f"qk_rope_cache: {', '.join(bad)} must be bfloat16 (it rounds as the bf16 modules do)")
    M, table = positions.numel(), block_table.reshape(-1, block_table.shape[-1])
    if qkv.numel() != M * (H + 2 * Hkv) * D:
        raise ValueError(f"qk_rope_cache: qkv has {qkv.numel()} values; {M} tokens of H={H}, Hkv={Hkv}, D={D} "
                         f"want {M * (H + 2 * Hkv) * D}")
    if D & (D - 1) or D < 2 or any(t.numel() != D for t in (q_norm, k_norm)) or cos.numel() != M * D \
            or sin.numel() != M * D:
        raise ValueError(f"qk_rope_cache: the head dim D={D} must be a power of two, the norms must have D "
                         f"values and cos / sin M x D")
    if M % table.shape[0]:
        raise ValueError(f"qk_rope_cache: {M} tokens do not split into the block table's {table.shape[0]} rows")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("qk_rope_cache: the K and V caches must be contiguous and of one shape")
    kw = pdl_launch(pdl, "qk_rope_cache", qkv)
    q = out if out is not None else torch.empty(M, H, D, dtype=qkv.dtype, device=qkv.device)
    launcher(qk_rope_cache_kernel)[(M, H + Hkv)](
        qkv.contiguous(), q, q_norm.contiguous(), k_norm.contiguous(), cos.contiguous(), sin.contiguous(),
        k_cache, v_cache, table.contiguous(), positions.reshape(-1).contiguous(), M // table.shape[0],
        table.shape[1], int(k_cache.shape[1]), float(eps), H=H, HKV=Hkv, D=D, PDL=pdl, num_warps=1, **kw)
    return q
