"""Decode schedule of ``dspark::moe_experts`` / ``moe_experts_mxfp4``: the chosen experts as GEMVs.

At decode sizes (a few tokens, each with its k experts, nearly all distinct) the grouped kernels
of ``moe.py`` pad every expert's one or two rows to a 16-row MMA tile and, for MXFP4, convert the
weights into the MMA operand layout: on the H200 they read the experts at 7-20 % of HBM. Here each
(token, slot) pair is a GEMV over its expert's rows on the CUDA cores, fp32 accumulation, without
the sort by expert:

* ``moe_decode_gate_up_kernel``, grid (M*k, cdiv(h, BLOCK_N / 2)): gate and up rows of the pair's
  expert against x[token], rounded to x's dtype like the eager matmul, then
  ``silu(min(gate, L)) * clamp(up, -L, L) * routing weight`` -> ``act [M*k, h]`` (x's dtype). A
  program's BLOCK_N weight rows interleave gate and up rows (2i: gate row i, 2i + 1: up row i), so
  each chunk of x is loaded and laid out for the products once for both.
* ``moe_decode_down_kernel``, grid (M*k, cdiv(d, BLOCK_N)): ``act[pair] @ w2[e]^T`` rounded to
  x's dtype per pair -> ``slot_out [M*k, d]`` (a program per token looping over its slots ran
  256 programs at one V4-Flash token);
* ``moe_decode_slot_sum_kernel``: a token's slots summed in fp32 in slot order and rounded once,
  the slot sum of ``grouped_experts``.

On sm_90+ GPUs the down and slot-sum kernels launch with programmatic dependent launch (``auto_pdl``,
``pdl=``): each starts while its predecessor runs and waits for its inputs before reading them.
The tile (BLOCK_N weight rows x BLOCK_K columns) comes from ``decode_tile`` by pair count.

Interleaving gate and up rows, with 16-byte word loads (a row is whole 4-word groups), took the
e4m3 route on an H100 (e14a918 -> 577fe7e, the same default tile size) at one V4-Flash token from
59.8 to 46.0 us (40 -> 52 % of HBM), V4-Pro from 117.5 to 99.5 us (53 -> 63 %), at 16 V4-Flash
tokens from 556 to 507 us, 467 with ``DECODE_WIDE`` (70 %); the gate/up kernel dropped from 96 to
80 registers, 6 programs per SM instead of 5 (Nsight Compute,
``ncu-moe-decode-NVIDIA-H100-80GB-HBM3-577fe7e.txt``). The two changes were timed together.

The rounding points are the grouped kernels', so only the summation order differs. A pair whose
expert another token also chose reads that expert again (from L2 when they run together): past a
few tokens per expert the grouped kernels win (``DECODE_MAX_PAIRS``).

MXFP4 decode in registers without a conversion instruction: an E2M1 code ``s e1 e0 m`` placed as
the fp32 bit pattern ``s 0000000 e1 e0 m 0...`` is its value times 2^-126 (``e = 0`` codes are
fp32 subnormals, which Triton's fp32 arithmetic keeps). The decode bounds these GEMVs by
instruction issue, not HBM (sm_90 SASS of the gate/up loop: 6.3 instructions per weight, 7.5 with
``bytes``; on the H200 23-35 % of HBM, moe-mxfp4-NVIDIA-H200-6b084b6.json.gz). ``DSPARK_MXFP4_DECODE``
picks (unset: ``auto``, ``e4m3`` on sm_89+ GPUs, else ``words``):

* ``words``: int32 words of 8 codes; code ``j`` of every word is two shifts and two masks
  (columns ``8i + j``, x split to match), and the 2^126 never multiplies a weight: x enters
  scaled by 2^63 and the per-32 E8M0 scale times 2^63 leaves on the fp32 partial sums. Exact while
  ``|x| < 2^65`` and each nonzero ``|w x| >= 2^-63`` (below, a product is an fp32 subnormal).
* ``bytes``: the packed bytes one by one, two codes each, every weight times 2^126 (as fast on
  the H200: 72.4 vs 73.1 us at one V4-Flash token).
* ``e4m3`` (sm_89+; the default there): the hardware's fp8 conversion does the decode (on an
  H100, V4-Flash shapes: 63.3 against ``words``' 75.2 us at one token, 565 against 713 at 16,
  moe-mxfp4-NVIDIA-H100-80GB-HBM3-f354b4b.json.gz). Each word's codes become e4m3 bytes with four
  32-bit operations per 8 codes (a code ``s e1 e0 m`` as the e4m3 byte ``s 000 e1 e0 m 00``: its
  value times 2^-6, the e = 0 codes as e4m3 subnormals), ``cvt.rn.f16x2.e4m3x2`` turns two bytes
  into two fp16 per instruction and one conversion per weight widens them to fp32; the products
  then chain as FFMAs. sm_90 SASS of the gate/up loop at V4-Flash shapes: 4.58 instructions per
  weight against ``words``' 6.52 with the one-token tile (16 x 512), 4.44 with ``DECODE_WIDE``
  (``benchmarks/moe_decode_sass.py``; fp16 -> fp32 widening 1, FFMA 1, the conversion 0.5, bit
  operations 1, the rest x's layout and the loop).
  Exact while each nonzero ``|w x|`` >= 2^-140 and ``|x| < 2^120``; the group sums leave times 2^6.
  The interpreter runs the same arithmetic with the ``words`` decode scaled by 2^120 (exact).

Tried and dropped (session 52, an H100, V4-Flash experts at one token, e4m3 62.8 us; commits
7a6e359, 4084de3, fe9b445; ``moe-mxfp4-NVIDIA-H100-80GB-HBM3-{aa1178a,4084de3,fe9b445}.json.gz``):
fp16 tensor-core GEMVs (weights through the same conversion into wgmma tiles, x as a block-diagonal
operand for the per-group scales; 3.25 SASS instructions per weight, loads pipelined) at 99.7-157.8 us
over 8 tiles, 1.6-2.2x slower at 1-32 tokens; K split over up to 8 programs with a ticket reduction,
62.8 -> 61.0-89.4 us; x loaded per code position instead of split through a layout change (12 -> 4
barriers per iteration, more instructions), 65.8 us. Session 53 (after the interleaving, 45.9 us;
``moe-mxfp4-NVIDIA-H100-80GB-HBM3-{577fe7e,5b2faa4}.json.gz``): the next weight tile loaded before
the current one is multiplied, 51.5 us (slower at every tile and size); a cap of 80 registers, 46.8
(before the interleaving it had taken 59.8 to 49.0: e14a918); 1024-column tiles, 47.9-55.8; the
down GEMV's first weight tile loaded before its PDL wait, 45.9. Session 54 (c293f47,
``moe-mxfp4-NVIDIA-H100-80GB-HBM3-c293f47.json.gz``): the K loop pipelined through shared memory
(``k_stages``, cp.async; no registers held): one V4-Flash token 46.3 us with the plain loop, 46.8 with
3 stages, 49.7 with 2; slower at 4 and 16 tokens (16: 519 against 454 with the wide tile's plain loop).
It stays a tile option (default 1) for GPUs with more bandwidth per SM to keep in flight (the H200).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import DENSE, INTERPRET, MXFP4, gdc_launch_dependents, gdc_wait, launcher, pdl_capable, pdl_launch, \
    tracing

BYTES = tl.constexpr(0)                     # packed bytes, each weight times 2^126
WORDS = tl.constexpr(1)                     # int32 words of 8 codes, 2^126 applied per group
E4M3 = tl.constexpr(2)                      # int32 words of 8 codes through the fp8 conversion, weights * 2^-6
DECODES = {"bytes": int(BYTES.value), "words": int(WORDS.value), "e4m3": int(E4M3.value)}
_INTERPRET = tl.constexpr(INTERPRET)
MXFP4_DECODE = os.environ.get("DSPARK_MXFP4_DECODE", "auto")
TWO_126 = tl.constexpr(8.507059173023462e37)      # a code's fp32 bit pattern is its value * 2^-126
X_SCALE = tl.constexpr(9.223372036854775808e18)    # words: x * 2^63 ...
SUM_SCALE = tl.constexpr(9.223372036854775808e18)  # ... and the sums * 2^(126 - 63)
E4M3_SUM_SCALE = tl.constexpr(64.0)                # e4m3: the sums * 2^6
TWO_120 = tl.constexpr(1.329227995784916e36)        # interpreter: words' 2^-126 scale -> e4m3's 2^-6
# 8 E2M1 codes of an int32 word ($8) -> their values * 2^-6 as fp32 ($0 .. $7, code order): even codes
# (low nibbles) and odd codes (high nibbles) as e4m3 bytes (mag << 2 | sign << 7), two per cvt.
E4M3_WORD_ASM = tl.constexpr("""{
.reg .b32 t, u, lo, hi, p0, p1, p2, p3;
.reg .b16 a0, a1, b0, b1, f0, f1, f2, f3, f4, f5, f6, f7;
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
mov.b32 {f0, f2}, p0;
mov.b32 {f1, f3}, p1;
mov.b32 {f4, f6}, p2;
mov.b32 {f5, f7}, p3;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
cvt.f32.f16 $4, f4;
cvt.f32.f16 $5, f5;
cvt.f32.f16 $6, f6;
cvt.f32.f16 $7, f7;
}""")
# (token, slot) pairs up to which the GEMV schedule runs, per weight format; above it the grouped
# kernels. H200, V4-Flash / V4-Pro experts (6 per token): bf16 GEMVs win up to 16 tokens and tie
# at 32 (moe-mxfp4-NVIDIA-H200-25e553b.json.gz: flash 998 vs 1095 us at 16, 1772 vs 1746 at 32), MXFP4 ones up to 32 tokens, 192 pairs, already with the
# byte-wise decode (moe-mxfp4-NVIDIA-H200-8fa3a00.json.gz: flash 1592 vs 1778 us, pro 4181 vs 5131 us
# for tl.dot_scaled grouped at 32 tokens; grouped wins at 64). Prefill is far above.
DECODE_MAX_PAIRS = {"dense": 128, "mxfp4": 192}
SUM_BLOCK = 256                             # columns per program of the slot sum (16 programs per V4-Flash token)
# Launch parameters per format: BLOCK_N output rows, BLOCK_K input columns per iteration.
DECODE_DEFAULTS = {"dense": dict(block_n=16, block_k=256, num_warps=4, k_stages=1),
                   "mxfp4": dict(block_n=16, block_k=512, num_warps=4, k_stages=1)}
# MXFP4 from this many (token, slot) pairs on: 32 rows x 256 columns per program. An H100, V4-Flash / V4-Pro
# experts, against the default tile (two runs, f043b77 / 5b2faa4): one token 45.9 / 109.2 against 45.8 / 99.3 us;
# 2 tokens 80.0 / 178.6 against 78.0 / 178.4; 4 tokens 137.9 / 332.8 against 142.0 / 344.5; 16 tokens
# 466.3 / 1206.5 against 507.2 / 1276.3 (moe-mxfp4-NVIDIA-H100-80GB-HBM3-{f043b77,5b2faa4}.json.gz).
DECODE_WIDE = dict(block_n=32, block_k=256, num_warps=4, k_stages=1)
DECODE_WIDE_PAIRS = 24


def decode_tile(dense: bool, pairs: int) -> dict:
    """The default launch tile of ``decode_experts`` for ``pairs`` (token, slot) pairs (a symbolic
    count, under tracing, keeps the default tile rather than guard on it)."""
    if not dense and isinstance(pairs, int) and pairs >= DECODE_WIDE_PAIRS:
        return dict(DECODE_WIDE)
    return dict(DECODE_DEFAULTS["dense" if dense else "mxfp4"])


@triton.jit
def e2m1_pair(b):
    """Packed bytes (int32 0..255) -> (low, high) codes' E2M1 values as float32, exact."""
    lo = ((b & 7) << 22) | ((b & 8) << 28)
    hi = ((b & 0x70) << 18) | ((b & 0x80) << 24)
    return lo.to(tl.float32, bitcast=True) * TWO_126, hi.to(tl.float32, bitcast=True) * TWO_126


@triton.jit
def e2m1_word_code(wd, J: tl.constexpr):
    """int32 words of 8 codes -> code J of each (bits 4J .. 4J+3) as fp32: its value times 2^-126."""
    if J < 6:
        mag = wd << (22 - 4 * J)                # bits 4J .. 4J+2 -> 22 .. 24
    else:
        mag = wd >> (4 * J - 22)
    if J < 7:
        sign = wd << (28 - 4 * J)               # bit 4J+3 -> 31
    else:
        sign = wd
    return ((mag & 0x01C00000) | (sign & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_word_e4m3(wd):
    """int32 words of 8 codes -> the 8 codes' values times 2^-6 as fp32 (``E4M3_WORD_ASM``; under
    the interpreter ``e2m1_word_code`` times 2^120, the same values)."""
    if _INTERPRET:
        return (e2m1_word_code(wd, 0) * TWO_120, e2m1_word_code(wd, 1) * TWO_120, e2m1_word_code(wd, 2) * TWO_120,
                e2m1_word_code(wd, 3) * TWO_120, e2m1_word_code(wd, 4) * TWO_120, e2m1_word_code(wd, 5) * TWO_120,
                e2m1_word_code(wd, 6) * TWO_120, e2m1_word_code(wd, 7) * TWO_120)
    return tl.inline_asm_elementwise(E4M3_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [wd], dtype=(tl.float32,) * 8,
                                     is_pure=True, pack=1)


@triton.jit
def _x_at(xrow, cols, ncols, SCALE: tl.constexpr):
    """xrow[cols] as fp32 times SCALE, 0 past ncols."""
    return tl.load(xrow + cols, mask=cols < ncols, other=0.0).to(tl.float32) * SCALE


@triton.jit
def split8(xv, W8: tl.constexpr):
    """xv [8 * W8] -> its 8 strided parts x[8i + t], t = 0..7, each [W8]."""
    even, odd = tl.split(tl.reshape(xv, [W8, 4, 2]))          # t = 2a + b
    e0, e2 = tl.split(tl.reshape(even, [W8, 2, 2]))          # t in {0, 4} / {2, 6}
    o1, o3 = tl.split(tl.reshape(odd, [W8, 2, 2]))           # t in {1, 5} / {3, 7}
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e2)
    x1, x5 = tl.split(o1)
    x3, x7 = tl.split(o3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def load_tile(w, w_scale, row_ptr_off, scale_off, rmask, k0, ncols, FORMAT: tl.constexpr, DECODE: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """The rows' weights at columns ``k0 .. k0 + BLOCK_K`` (0 past ncols) as stored: dense values
    [BN, BK], MXFP4 int32 words of 8 codes [BN, BK/8] or packed bytes [BN, BK/2] as int32, with the
    MXFP4 E8M0 exponents [BN, BK/32] int32 (dense: 0). row_ptr_off / scale_off: ``_row_offsets``."""
    if FORMAT == DENSE:
        cols = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w + row_ptr_off[:, None] + cols[None, :], mask=rmask[:, None] & (cols < ncols)[None, :],
                       other=0.0), 0
    else:
        if DECODE == BYTES:
            byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            tile = tl.load(w + row_ptr_off[:, None] + byte[None, :], mask=rmask[:, None] & (byte < ncols // 2)[None, :],
                           other=0).to(tl.uint8, bitcast=True).to(tl.int32)
        else:                        # a row is whole 32-column groups (4 words): the bound lets loads be 16 bytes
            word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            tile = tl.load(w + row_ptr_off[:, None] + word[None, :],
                           mask=rmask[:, None] & (word < tl.multiple_of(ncols // 8, 4))[None, :], other=0)
        g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        e = tl.load(w_scale + scale_off[:, None] + g[None, :], mask=rmask[:, None] & (g < ncols // 32)[None, :],
                    other=0).to(tl.uint8, bitcast=True).to(tl.int32)
        return tile, e


@triton.jit
def tile_product(tile, e, xrow, k0, ncols, FORMAT: tl.constexpr, DECODE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``load_tile``'s tile times ``xrow[k0 : k0 + BLOCK_K]`` as an fp32 partial [BLOCK_N, PART_W]
    (``part_width``) that ``gemv_rows`` accumulates over the K loop and sums once at its end
    (``row_sums``). Dense: one column per weight, no reduction per iteration (on the H200 67-89 % of
    HBM from one token on; a sum per iteration had 41 % at one token). MXFP4: one column per
    32-column scale group (per-weight partials with the scale read per packed unit were slower
    there: 293 vs 214 us at 4 V4-Flash tokens)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    if FORMAT == DENSE:
        return tile.to(tl.float32) * _x_at(xrow, cols, ncols, 1.0)[None, :]                # [BN, BK]
    else:
        G: tl.constexpr = BLOCK_K // 32
        if DECODE == E4M3:                               # fp8 conversion, then one FFMA per weight
            x0, x1, x2, x3, x4, x5, x6, x7 = split8(_x_at(xrow, cols, ncols, 1.0), BLOCK_K // 8)
            c0, c1, c2, c3, c4, c5, c6, c7 = e2m1_word_e4m3(tile)
            part = c0 * x0[None, :]
            part += c1 * x1[None, :]
            part += c2 * x2[None, :]
            part += c3 * x3[None, :]
            part += c4 * x4[None, :]
            part += c5 * x5[None, :]
            part += c6 * x6[None, :]
            part += c7 * x7[None, :]
            part = tl.sum(tl.reshape(part, [BLOCK_N, G, 4]), 2)                                # per 32 columns
        elif DECODE == WORDS:
            x0, x1, x2, x3, x4, x5, x6, x7 = split8(_x_at(xrow, cols, ncols, X_SCALE), BLOCK_K // 8)
            part = e2m1_word_code(tile, 0) * x0[None, :] + e2m1_word_code(tile, 1) * x1[None, :]
            part += e2m1_word_code(tile, 2) * x2[None, :] + e2m1_word_code(tile, 3) * x3[None, :]
            part += e2m1_word_code(tile, 4) * x4[None, :] + e2m1_word_code(tile, 5) * x5[None, :]
            part += e2m1_word_code(tile, 6) * x6[None, :] + e2m1_word_code(tile, 7) * x7[None, :]
            part = tl.sum(tl.reshape(part, [BLOCK_N, G, 4]), 2)                                # per 32 columns
        else:
            x_even, x_odd = tl.split(tl.reshape(_x_at(xrow, cols, ncols, 1.0), [BLOCK_K // 2, 2]))   # columns 2j, 2j+1
            w_lo, w_hi = e2m1_pair(tile)
            part = tl.sum(tl.reshape(w_lo * x_even[None, :] + w_hi * x_odd[None, :], [BLOCK_N, G, 16]), 2)
        return part * (e << 23).to(tl.float32, bitcast=True)                                # * 2^(e-127)


@triton.jit
def gemv_rows(w, w_scale, row_ptr_off, scale_off, rmask, xrow, ncols, FORMAT: tl.constexpr, DECODE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PART_W: tl.constexpr, K_STAGES: tl.constexpr = 1):
    """The rows [BLOCK_N] of W times xrow [ncols], fp32. K_STAGES > 1: Triton's pipeliner copies the
    weight tiles of the next K_STAGES - 1 iterations into shared memory (``cp.async``) while this one
    is multiplied, so more bytes are in flight per SM without holding registers (a plain ``range``
    leaves each tile's load to wait in its iteration; the pipeliner only takes loads that feed no
    ``tl.dot`` when the loop asks for stages). (Loading each next tile before multiplying
    the current one, registers double-buffered, was slower at every tile and size on an H100: V4-Flash
    one token 45.9 -> 51.5 us, moe-mxfp4-NVIDIA-H100-80GB-HBM3-577fe7e.json.gz. So was nothing gained by
    the down GEMV loading its first tile before waiting on the gate/up kernel under PDL, 5b2faa4: 45.9
    against 46.0 us.)"""
    acc = tl.zeros([BLOCK_N, PART_W], tl.float32)
    for k0 in tl.range(0, ncols, BLOCK_K, num_stages=K_STAGES):
        tile, e = load_tile(w, w_scale, row_ptr_off, scale_off, rmask, k0, ncols, FORMAT, DECODE, BLOCK_K)
        acc += tile_product(tile, e, xrow, k0, ncols, FORMAT, DECODE, BLOCK_N, BLOCK_K)
    return row_sums(acc, FORMAT, DECODE)


@triton.jit
def row_sums(acc, FORMAT: tl.constexpr, DECODE: tl.constexpr):
    """The accumulated partials [BLOCK_N, PART_W] -> [BLOCK_N] (words: x entered times 2^63)."""
    y = tl.sum(acc, 1)
    if FORMAT != DENSE:
        if DECODE == WORDS:
            y = y * SUM_SCALE
        elif DECODE == E4M3:
            y = y * E4M3_SUM_SCALE
    return y


def part_width(dense: bool, block_k: int) -> int:
    """Columns of ``tile_product``'s partial: one per weight (dense) or per 32-column group (MXFP4)."""
    return block_k if dense else block_k // 32


@triton.jit
def _row_offsets(rows, ncols, FORMAT: tl.constexpr, DECODE: tl.constexpr):
    """Row starts in W's elements (dense; MXFP4 packed bytes or int32 words) and in its scales."""
    r64 = rows.to(tl.int64)
    if FORMAT == DENSE:
        return r64 * ncols, r64
    elif DECODE != BYTES:                   # int32 words; a row is whole 32-column groups (4 words): 16-byte loads
        return tl.multiple_of(r64 * (ncols // 8), 4), r64 * (ncols // 32)
    else:
        return r64 * (ncols // 2), r64 * (ncols // 32)


@triton.jit
def moe_decode_gate_up_kernel(x, expert_ids, routing_weights, w13, w13_scale, act, first_expert, limit,
                              E, D, H, K, HAS_LIMIT: tl.constexpr, FORMAT: tl.constexpr,
                              DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PART_W: tl.constexpr, PDL: tl.constexpr = False, K_STAGES: tl.constexpr = 1):
    """Grid (M*K, cdiv(H, BLOCK_N / 2)). x [M, D]; expert_ids / routing_weights [M*K]; w13 [E, 2H, D] (MXFP4:
    [E, 2H, D/2] + [E, 2H, D/32]) -> act [M*K, H] for live pairs. PDL: lets the down kernel launch at once."""
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)
    gid = tl.load(expert_ids + pair).to(tl.int64)
    e = gid - first_expert
    if (gid >= 0) & (e >= 0) & (e < E):
        tok = pair // K
        # gate and up rows interleaved in one tile of BLOCK_N rows: row 2i + u is gate (u = 0) / up (u = 1) row
        # n_i, so x's chunk is loaded and laid out once per iteration for both
        HALF: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        n2 = tl.program_id(1) * HALF + r // 2
        off, soff = _row_offsets(e * 2 * H + (r % 2) * H + n2, D, FORMAT, DECODE)
        y = gemv_rows(w13, w13_scale, off, soff, n2 < H, x + tok * D, D, FORMAT, DECODE, BLOCK_N, BLOCK_K, PART_W,
                      K_STAGES)
        y = y.to(x.dtype.element_ty).to(tl.float32)                                      # the eager matmul's rounding
        gate, up = tl.split(tl.reshape(y, [HALF, 2]))
        n = tl.program_id(1) * HALF + tl.arange(0, HALF)
        nmask = n < H
        if HAS_LIMIT:
            lim = tl.cast(limit, tl.float32)      # AOTInductor passes Python floats as fp64 (Triton 3.6)
            gate = tl.minimum(gate, lim)
            up = tl.minimum(tl.maximum(up, -lim), lim)
        wt = tl.load(routing_weights + pair).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up * wt
        tl.store(act + pair * H + n, h.to(act.dtype.element_ty), mask=nmask)


@triton.jit
def moe_decode_down_kernel(act, expert_ids, w2, w2_scale, slot_out, first_expert, E, D, H, K, FORMAT: tl.constexpr,
                           DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PART_W: tl.constexpr,
                           PDL: tl.constexpr = False, K_STAGES: tl.constexpr = 1):
    """Grid (M*K, cdiv(D, BLOCK_N)), one program per pair and row block (a program per token
    looping over its slots left most of the H200 idle at one token). act [M*K, H]; w2 [E, D, H]
    (MXFP4: [E, D, H/2] + [E, D, H/32]) -> slot_out [M*K, D]: each pair's rows in out's dtype, 0 for
    pairs that are not live. PDL (launched with ``launch_pdl``): launched while the gate/up kernel
    runs, it lets the slot sum launch and waits for act before its first read or write."""
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    gid = tl.load(expert_ids + pair).to(tl.int64)
    e = gid - first_expert
    y = tl.zeros([BLOCK_N], tl.float32)
    if PDL:
        gdc_wait()
    if (gid >= 0) & (e >= 0) & (e < E):
        off, soff = _row_offsets(e * D + n, H, FORMAT, DECODE)
        y = gemv_rows(w2, w2_scale, off, soff, nmask, act + pair * H, H, FORMAT, DECODE, BLOCK_N, BLOCK_K, PART_W,
                      K_STAGES)
    tl.store(slot_out + pair * D + n, y.to(slot_out.dtype.element_ty), mask=nmask)


@triton.jit
def moe_decode_slot_sum_kernel(slot_out, out, D, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (M, cdiv(D, BLOCK)). slot_out [M*K, D] -> out [M, D]: the token's slots summed in fp32
    in slot order (the grouped kernels' rounding: each slot rounded to out's dtype first). K is a
    constant so the slots' loads are all issued before the first add (a loop over them waited for
    each). One V4-Flash token on an H100 under Nsight Compute: 5.38 us over 4 programs, 2.85 over 16
    (``ncu-moe-decode-NVIDIA-H100-80GB-HBM3-{26008cd,62fc304}.txt``)."""
    if PDL:
        gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < D
    y = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        y += tl.load(slot_out + (m * K + j) * D + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out + m * D + n, y.to(out.dtype.element_ty), mask=nmask)


def use_decode(x: Tensor, expert_ids: Tensor, dense: bool) -> bool:
    """The GEMV schedule for a concrete, small pair count (a symbolic one, as in a ``torch.export``
    with dynamic tokens, keeps the grouped kernels, which serve every size)."""
    pairs = expert_ids.numel()
    return isinstance(pairs, int) and pairs <= DECODE_MAX_PAIRS["dense" if dense else "mxfp4"] and x.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def auto_pdl(x: Tensor) -> bool:
    """Programmatic dependent launch for eager calls on sm_90+ GPUs (an H100, V4-Flash experts: one
    token 62.8 -> 60.9 us, V4-Pro 121.0 -> 118.8, moe-mxfp4-NVIDIA-H100-80GB-HBM3-fe9b445.json.gz);
    off under tracing (export / AOTInductor keep plain launches), the interpreter and older GPUs."""
    return not tracing() and pdl_capable(x.device)


def auto_decode(device: torch.device) -> str:
    """``DSPARK_MXFP4_DECODE=auto``'s route on ``device``: ``e4m3`` on sm_89+ GPUs (the fp8
    conversion instruction), ``words`` elsewhere (older GPUs, the interpreter)."""
    if device.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(device) >= (8, 9):
        return "e4m3"
    return "words"


def decode_experts(x: Tensor, expert_ids: Tensor, routing_weights: Tensor, w13: tuple, w2: tuple,
                   first_expert: int, swiglu_limit: float, H: int, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int | None = None, decode: str | None = None,
                   pdl: bool | None = None, maxnreg: int | None = None, k_stages: int | None = None) -> Tensor:
    """The two GEMV launches and the slot sum; ``w13`` / ``w2``: (values, None) dense or (packed, E8M0 scales) MXFP4;
    H the intermediate size; ``pdl``: the down and slot-sum kernels with programmatic dependent launch
    (None: ``auto_pdl``); ``maxnreg``: a register cap for the two GEMVs (Triton's launch option; more
    programs per SM, perhaps spills; 80 was timed, the module's docstring); ``k_stages``: weight tiles in
    flight per GEMV program (``gemv_rows``' K_STAGES); unset tile parameters from ``decode_tile``.
    Same contract as ``moe.grouped_experts``."""
    dense = w13[1] is None
    cfg = {**decode_tile(dense, expert_ids.numel()),
           **{k: v for k, v in dict(block_n=block_n, block_k=block_k, num_warps=num_warps,
                                    k_stages=k_stages).items() if v is not None}}
    if not dense and cfg["block_k"] % 32:
        raise ValueError(f"moe decode: MXFP4 needs block_k a multiple of 32, got {cfg['block_k']}")
    if not 1 <= cfg["k_stages"] <= 8:
        raise ValueError(f"moe decode: k_stages must be within 1..8, got {cfg['k_stages']}")
    if cfg["block_n"] < 2:
        raise ValueError(f"moe decode: block_n (weight rows per program, gate and up rows interleaved) must be "
                         f">= 2, got {cfg['block_n']}")
    M, D = x.shape
    k = expert_ids.shape[1]
    E = w13[0].shape[0]
    fmt = int((DENSE if dense else MXFP4).value)
    x, ids = x.contiguous(), expert_ids.contiguous()
    w13_v, w2_v = w13[0].contiguous(), w2[0].contiguous()
    w13_s, w2_s = (w13_v, w2_v) if dense else (w13[1].contiguous(), w2[1].contiguous())   # dense: unread
    act = torch.empty((M * k, H), dtype=x.dtype, device=x.device)
    slot_out = torch.empty((M * k, D), dtype=x.dtype, device=x.device)
    out = torch.empty((M, D), dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg["block_n"], cfg["block_k"], cfg["num_warps"]
    decode = decode or MXFP4_DECODE
    if decode == "auto":
        decode = auto_decode(x.device)
    if decode not in DECODES:
        raise ValueError(f"moe decode: decode must be one of {sorted(DECODES)} or auto, got {decode!r}")
    if not dense and decode != "bytes":                  # 8 codes per int32 (rows are 16-byte multiples)
        w13_v, w2_v = w13_v.view(torch.int32), w2_v.view(torch.int32)
    part_w = part_width(dense, bk)
    decode = DECODES[decode]
    pdl = auto_pdl(x) if pdl is None else bool(pdl)
    pdl_kw = pdl_launch(pdl, "moe decode", x)
    if maxnreg is not None and not 24 <= maxnreg <= 255:
        raise ValueError(f"moe decode: maxnreg must be within 24..255 registers, got {maxnreg}")
    cap = {} if maxnreg is None else {"maxnreg": int(maxnreg)}
    launcher(moe_decode_gate_up_kernel)[(M * k, triton.cdiv(H, bn // 2))](
        x, ids, routing_weights.contiguous(), w13_v, w13_s, act, int(first_expert), float(swiglu_limit),
        E, D, H, k, HAS_LIMIT=swiglu_limit > 0, FORMAT=fmt, DECODE=decode, BLOCK_N=bn, BLOCK_K=bk, PART_W=part_w,
        PDL=pdl, K_STAGES=cfg["k_stages"], num_warps=warps, **cap)
    launcher(moe_decode_down_kernel)[(M * k, triton.cdiv(D, bn))](
        act, ids, w2_v, w2_s, slot_out, int(first_expert), E, D, H, k, FORMAT=fmt, DECODE=decode, BLOCK_N=bn,
        BLOCK_K=bk, PART_W=part_w, PDL=pdl, K_STAGES=cfg["k_stages"], num_warps=warps, **cap, **pdl_kw)
    launcher(moe_decode_slot_sum_kernel)[(M, triton.cdiv(D, SUM_BLOCK))](slot_out, out, D, K=k, BLOCK=SUM_BLOCK,
                                                                         PDL=pdl, num_warps=2, **pdl_kw)
    return out
