"""MXFP4 decode GEMVs of ``dspark::moe_experts_mxfp4`` on the tensor cores (``DSPARK_MXFP4_DECODE=mma``).

The CUDA-core GEMVs of ``moe_decode.py`` spend 4.2-4.4 instructions per weight (an fp16 -> fp32
widening and an FFMA each, the bit work, x's layout) and wait for every weight tile before decoding
it: on the H100 and H200 they read V4-Flash experts at 26-30 % of HBM at one token. Here the
weights go to an fp16 MMA instead:

* each int32 word of 8 E2M1 codes becomes 8 fp16 values (their values times 2^-6) with the fp8
  conversion of ``moe_decode.E4M3_WORD_ASM`` (bit work, then ``cvt.rn.f16x2.e4m3x2``), no
  widening. The tile's column ``8i + j'`` holds code ``CODE_ORDER[j']`` of word ``i``: the order the
  conversion leaves the fp16 pairs in, so no repacking before the MMA;
* the per-32-column E8M0 scales multiply per (row, group), after the products: x enters as a
  block-diagonal operand ``[BLOCK_K, NG]`` (column ``g`` holds x on group ``g``'s columns, 0
  elsewhere), so ``W_tile @ x_groups`` is ``[BLOCK_N, NG]``, one fp32 partial per row and group,
  which the scales multiply before the K loop accumulates it;
* x goes to fp16 times a power of two ``xs`` that puts the token's largest ``|x|`` into
  [2^14, 2^15) (``x_scale``); bf16 / fp16 x converts exactly, except elements below
  ``max |x| * 2^-32``, which keep fp16's 2^-24 grid (an error below ``max |x| * 2^-40``). Products
  are exact in the MMA's fp32 accumulation; the sums leave times ``2^6 / xs``.

Triton pipelines the word loads (they feed ``tl.dot``) with ``num_stages``; sm_90 SASS of the
gate/up loop at 64 x 256 tiles: 3.25 instructions per weight (``benchmarks/moe_decode_sass.py``).
The rounding points are ``moe_decode``'s (gate and up rounded to x's dtype, each slot's rows,
the slot sum), so only the summation order differs. fp32 x keeps the CUDA-core routes (its 24-bit
values do not fit fp16).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERPRET
from .moe_decode import E4M3_SUM_SCALE, TWO_120, e2m1_word_code

_INTERPRET = tl.constexpr(INTERPRET)
CODE_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)      # code of word i at tile column 8i + j' (bits 0 and 1 of j' swapped)
X_BLOCK = tl.constexpr(1024)               # x elements per iteration of the scale's max
# 8 E2M1 codes of an int32 word ($8) -> their values * 2^-6 as fp16 ($0 .. $7 in CODE_ORDER): even codes
# (low nibbles) and odd codes (high nibbles) as e4m3 bytes (mag << 2 | sign << 7), two per cvt.
F16_WORD_ASM = tl.constexpr("""{
.reg .b32 t, u, lo, hi, p0, p1, p2, p3;
.reg .b16 a0, a1, b0, b1;
shl.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 u, $8, 4;
and.b32 u, u, 0x80808080;
or.b32 lo, t, u;
shr.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $8, 0x80808080;
or.b32 hi, t, u;
mov.b32 {a0, a1}, lo;
mov.b32 {b0, b1}, hi;
cvt.rn.f16x2.e4m3x2 p0, a0;
cvt.rn.f16x2.e4m3x2 p1, b0;
cvt.rn.f16x2.e4m3x2 p2, a1;
cvt.rn.f16x2.e4m3x2 p3, b1;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}""")


@triton.jit
def _code16(wd, J: tl.constexpr):
    return (e2m1_word_code(wd, J) * TWO_120).to(tl.float16)


@triton.jit
def word_codes_f16(wd):
    """int32 words of 8 codes -> 8 fp16 tensors, the codes' values times 2^-6 in CODE_ORDER (under
    the interpreter ``e2m1_word_code`` times 2^120, the same values)."""
    if _INTERPRET:
        return (_code16(wd, 0), _code16(wd, 2), _code16(wd, 1), _code16(wd, 3),
                _code16(wd, 4), _code16(wd, 6), _code16(wd, 5), _code16(wd, 7))
    return tl.inline_asm_elementwise(F16_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [wd], dtype=(tl.float16,) * 8,
                                     is_pure=True, pack=1)


@triton.jit
def weight_tile(wd, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] words -> [BLOCK_N, BLOCK_K] fp16, column 8i + j' = code CODE_ORDER[j'] of word i
    (each join adds the innermost dimension: j' = 4a + 2b + c)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = word_codes_f16(wd)
    t = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(t, [BLOCK_N, BLOCK_K])


@triton.jit
def x_scale(xrow, ncols):
    """The power of two (fp32) that puts max |xrow[:ncols]| into [2^14, 2^15) (2^127 for a max
    below 2^-113; a non-finite max keeps its inf / nan through the products)."""
    k = tl.arange(0, X_BLOCK)
    amax = tl.zeros([X_BLOCK], tl.float32)
    for k0 in range(0, ncols, X_BLOCK):
        amax = tl.maximum(amax, tl.abs(tl.load(xrow + k0 + k, mask=k0 + k < ncols, other=0.0).to(tl.float32)))
    ex = tl.maximum((tl.max(amax, 0).to(tl.int32, bitcast=True) >> 23) & 255, 14)
    return ((268 - ex) << 23).to(tl.float32, bitcast=True)          # 2^(14 - (ex - 127))


@triton.jit
def x_groups(xrow, k0, ncols, xs, BLOCK_K: tl.constexpr, NG: tl.constexpr):
    """xrow[k0 : k0 + BLOCK_K] * xs as fp16 on a block diagonal [BLOCK_K, NG] in ``weight_tile``'s
    column order: row k holds x at its column (k with bits 0 and 1 swapped) in column k // 32."""
    k = tl.arange(0, BLOCK_K)
    col = k0 + ((k & -8) | (k & 4) | ((k & 1) << 1) | ((k >> 1) & 1))
    xv = (tl.load(xrow + col, mask=col < ncols, other=0.0).to(tl.float32) * xs).to(tl.float16)
    g = tl.arange(0, NG)
    return tl.trans(tl.where(g[:, None] == (k // 32)[None, :], xv[None, :], 0.0))


@triton.jit
def mma_chunk(w, w_scale, rows, rmask, xg, k0, ncols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NG: tl.constexpr):
    """W[rows, k0 : k0 + BLOCK_K] (int32 words of 8 codes, E8M0 scales per 32 columns) against the
    block-diagonal xg: [BLOCK_N, NG] fp32, each row's group sums times their scales (columns past
    the chunk's groups 0)."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    wd = tl.load(w + rows[:, None] * (ncols // 8) + word[None, :],
                 mask=rmask[:, None] & (word < ncols // 8)[None, :], other=0)
    g = k0 // 32 + tl.arange(0, NG)
    gmask = rmask[:, None] & ((g < ncols // 32) & (tl.arange(0, NG) < BLOCK_K // 32))[None, :]
    e = tl.load(w_scale + rows[:, None] * (ncols // 32) + g[None, :], mask=gmask, other=0)
    part = tl.dot(weight_tile(wd, BLOCK_N, BLOCK_K), xg)
    return part * (e.to(tl.uint8, bitcast=True).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mma_rows(w, w_scale, rows, rmask, xrow, ncols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows] @ xrow[:ncols] in fp32 ([BLOCK_N]): the K loop of ``mma_chunk``s, one partial per
    row and group, summed at the end."""
    NG: tl.constexpr = 16 if BLOCK_K // 32 < 16 else BLOCK_K // 32        # the MMA's N is at least 16
    xs = x_scale(xrow, ncols)
    acc = tl.zeros([BLOCK_N, NG], tl.float32)
    for k0 in range(0, ncols, BLOCK_K):
        xg = x_groups(xrow, k0, ncols, xs, BLOCK_K, NG)
        acc += mma_chunk(w, w_scale, rows, rmask, xg, k0, ncols, BLOCK_N, BLOCK_K, NG)
    return tl.sum(acc, 1) * (E4M3_SUM_SCALE / xs)


@triton.jit
def moe_decode_gate_up_mma_kernel(x, expert_ids, routing_weights, w13, w13_scale, act, first_expert, limit,
                                  E, D, H, K, HAS_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr):
    """Grid (M*K, cdiv(H, BLOCK_N)), ``moe_decode_gate_up_kernel``'s contract for MXFP4 words:
    x [M, D] bf16 / fp16; w13 [E, 2H, D/8] int32 + [E, 2H, D/32] E8M0 -> act [M*K, H] for live pairs.
    Gate and up share the K loop (one x block diagonal, two MMAs)."""
    pair = tl.program_id(0).to(tl.int64)
    gid = tl.load(expert_ids + pair).to(tl.int64)
    e = gid - first_expert
    if (gid >= 0) & (e >= 0) & (e < E):
        NG: tl.constexpr = 16 if BLOCK_K // 32 < 16 else BLOCK_K // 32
        xrow = x + pair // K * D
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        gate_rows = e * 2 * H + n
        up_rows = gate_rows + H
        xs = x_scale(xrow, D)
        acc_g = tl.zeros([BLOCK_N, NG], tl.float32)
        acc_u = tl.zeros([BLOCK_N, NG], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            xg = x_groups(xrow, k0, D, xs, BLOCK_K, NG)
            acc_g += mma_chunk(w13, w13_scale, gate_rows, nmask, xg, k0, D, BLOCK_N, BLOCK_K, NG)
            acc_u += mma_chunk(w13, w13_scale, up_rows, nmask, xg, k0, D, BLOCK_N, BLOCK_K, NG)
        back = E4M3_SUM_SCALE / xs
        gate = (tl.sum(acc_g, 1) * back).to(x.dtype.element_ty).to(tl.float32)    # the eager matmul's rounding
        up = (tl.sum(acc_u, 1) * back).to(x.dtype.element_ty).to(tl.float32)
        if HAS_LIMIT:
            lim = tl.cast(limit, tl.float32)      # AOTInductor passes Python floats as fp64 (Triton 3.6)
            gate = tl.minimum(gate, lim)
            up = tl.minimum(tl.maximum(up, -lim), lim)
        wt = tl.load(routing_weights + pair).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up * wt
        tl.store(act + pair * H + n, h.to(act.dtype.element_ty), mask=nmask)


@triton.jit
def moe_decode_down_mma_kernel(act, expert_ids, w2, w2_scale, slot_out, first_expert, E, D, H, K,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (M*K, cdiv(D, BLOCK_N)), ``moe_decode_down_kernel``'s contract for MXFP4 words: act [M*K, H];
    w2 [E, D, H/8] int32 + [E, D, H/32] E8M0 -> slot_out [M*K, D] (0 for pairs that are not live)."""
    pair = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    gid = tl.load(expert_ids + pair).to(tl.int64)
    e = gid - first_expert
    y = tl.zeros([BLOCK_N], tl.float32)
    if (gid >= 0) & (e >= 0) & (e < E):
        y = mma_rows(w2, w2_scale, e * D + n, nmask, act + pair * H, H, BLOCK_N, BLOCK_K)
    tl.store(slot_out + pair * D + n, y.to(slot_out.dtype.element_ty), mask=nmask)
