"""Every E2M1 code at every position of a packed int32 word through ``moe_decode.gemv_rows``.

Rows of 128 columns whose code at column c of row r is (r + c) % 16 (all 16 codes at each of the 8
word positions), E8M0 scales 2^-1 .. 2^1 per 32-column group, and x = +-2^a for one a per run: every
product is a multiple of 2^(a-2) and each row's sum needs a dozen bits, so the GEMV equals the
dequantised reference exactly in any summation order. a spans the range the ``words`` route
promises to be exact on (|x| < 2^65, nonzero |w x| >= 2^-63; ``e4m3``: |x| < 2^120, >= 2^-140).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_trt.plugins.kernels.common import MXFP4
from dspark_trt.plugins.kernels.moe_decode import DECODES, _row_offsets, gemv_rows, part_width

ROWS, COLS = 16, 128
EXPONENTS = (-60, -20, 0, 20, 60)


@triton.jit
def _gemv_rows_kernel(w, w_scale, x, out, ncols, DECODE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PART_W: tl.constexpr):
    n = tl.arange(0, BLOCK_N)
    off, soff = _row_offsets(n, ncols, MXFP4, DECODE)
    tl.store(out + n, gemv_rows(w, w_scale, off, soff, n < BLOCK_N, x, ncols, MXFP4, DECODE, BLOCK_N, BLOCK_K, PART_W))


def every_code_weights(device):
    """-> (packed [ROWS, COLS/2] uint8, scales [ROWS, COLS/32] uint8, dequantised fp64 [ROWS, COLS])."""
    from dspark_trt.plugins.moe_experts_mxfp4 import dequantize_mxfp4
    code = (torch.arange(ROWS)[:, None] + torch.arange(COLS)[None, :]) % 16
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)               # low nibble: even column
    scale = (126 + (torch.arange(ROWS)[:, None] + torch.arange(COLS // 32)[None, :]) % 3).to(torch.uint8)
    return packed.to(device), scale.to(device), dequantize_mxfp4(packed, scale, torch.float64).to(device)


def every_code_case(device, decode: str) -> dict:
    """-> {"exact": every run equal to the reference, "runs": [(a, max abs error)]}."""
    packed, scale, ref_w = every_code_weights(device)
    signs = torch.where(torch.arange(COLS) % 3 == 0, -1.0, 1.0).double().to(device)
    w = packed if decode == "bytes" else packed.view(torch.int32)
    runs = []
    for a in EXPONENTS:
        x = signs * 2.0 ** a
        want = (ref_w @ x).float()
        got = torch.empty(ROWS, dtype=torch.float32, device=device)
        _gemv_rows_kernel[(1,)](w, scale, x.float(), got, COLS, DECODE=DECODES[decode], BLOCK_N=ROWS, BLOCK_K=64,
                                 PART_W=part_width(False, 64))
        runs.append((a, float((got.double() - want.double()).abs().max()), bool(torch.equal(got, want))))
    return {"exact": all(r[2] for r in runs), "runs": runs}
