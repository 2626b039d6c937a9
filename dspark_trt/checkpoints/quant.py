"""DeepSeek-V4 checkpoint number formats (algorithm doc §8.6): dequantise for the reference path,
quantise for writing test checkpoints.

* E8M0 scale: one exponent byte, value ``2^(e - 127)``, 255 = NaN (``torch.float8_e8m0fnu`` or
  the raw ``uint8``).
* FP8 block: ``float8_e4m3fn`` weight, one E8M0 scale per 128x128 block,
  scale shape ``[ceil(out / 128), ceil(in / 128)]``.
* MXFP4: int8 ``[out, in / 2]``, two E2M1 codes per byte, low nibble = even input index;
  magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6`` for codes 0-7, bit 3 = sign; one E8M0 scale per 1x32
  group, shape ``[out, in / 32]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_BLOCK = 128
MXFP4_GROUP = 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX = 448.0


class QuantFormatError(ValueError):
    pass


def e8m0_to_float(scale: Tensor) -> Tensor:
    """E8M0 bytes (float8_e8m0fnu or uint8) -> float32 powers of two (255 -> NaN)."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise QuantFormatError(f"E8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    e = scale.to(torch.int32)
    v = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, float("nan"), v)


def float_to_e8m0(exponent: Tensor) -> Tensor:
    """Integer exponents e (value 2^e) -> float8_e8m0fnu bytes."""
    return (exponent.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand(scale: Tensor, rows: int, cols: int, br: int, bc: int) -> Tensor:
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def check_fp8_block(w: Tensor, scale: Tensor, block: int = FP8_BLOCK) -> None:
    """``QuantFormatError`` unless ``w`` is a 2-D float8_e4m3fn weight and ``scale`` has one entry
    per ``block`` x ``block`` block of it."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise QuantFormatError(f"FP8 block weight must be 2-D float8_e4m3fn, got {w.dtype} {tuple(w.shape)}")
    want = (-(-w.shape[0] // block), -(-w.shape[1] // block))
    if tuple(scale.shape) != want:
        raise QuantFormatError(f"FP8 block scale has shape {tuple(scale.shape)}, expected {want} "
                               f"for a weight of shape {tuple(w.shape)}")


def dequant_fp8_block(w: Tensor, scale: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """float8_e4m3fn [out, in] with E8M0 scale [ceil(out/b), ceil(in/b)] -> float32 [out, in]."""
    check_fp8_block(w, scale, block)
    return w.float() * _expand(e8m0_to_float(scale), *w.shape, block, block)


def check_mxfp4(packed: Tensor, scale: Tensor, group: int = MXFP4_GROUP) -> None:
    """``QuantFormatError`` unless ``packed`` is 2-D int8 / uint8 [out, in/2] and ``scale`` has one
    entry per ``group`` logical columns, [out, in/group]."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise QuantFormatError(f"MXFP4 weight must be 2-D int8, got {packed.dtype} {tuple(packed.shape)}")
    out, cols = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (out, cols // group) or cols % group:
        raise QuantFormatError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected "
                               f"{(out, cols // group)} for logical weight [{out}, {cols}]")


def dequant_mxfp4(packed: Tensor, scale: Tensor, group: int = MXFP4_GROUP) -> Tensor:
    """int8/uint8 [out, in/2] with E8M0 scale [out, in/group] -> float32 [out, in]."""
    check_mxfp4(packed, scale, group)
    out, cols = packed.shape[0], packed.shape[1] * 2
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], -1).view(out, cols)          # low nibble = even index
    mag = E2M1.to(packed.device)[codes & 7]
    val = torch.where(codes & 8 != 0, -mag, mag)
    return val * _expand(e8m0_to_float(scale), out, cols, 1, group)


def _pow2_exponent(amax: Tensor, top: float) -> Tensor:
    """Smallest e with amax / 2^e <= top (e = 0 for all-zero blocks)."""
    e = torch.ceil(torch.log2(amax.clamp(min=1e-30) / top))
    return torch.where(amax > 0, e, 0.0).to(torch.int32)


def quant_fp8_block(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], E8M0 scale [ceil(out/b), ceil(in/b)])."""
    out, inp = w.shape
    R, C = -(-out // block), -(-inp // block)
    padded = w.new_zeros(R * block, C * block, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    amax = padded.view(R, block, C, block).abs().amax((1, 3))
    e = _pow2_exponent(amax, FP8_MAX)
    q = (w.float() / _expand(torch.ldexp(torch.ones_like(amax), e), out, inp, block, block))
    return q.to(torch.float8_e4m3fn), float_to_e8m0(e)


def quant_mxfp4_u8(w: Tensor) -> tuple[Tensor, Tensor]:
    """``quant_mxfp4`` as the uint8 bytes an ``Mxfp4Linear`` holds: (packed [out, in/2], E8M0 [out, in/32])."""
    q, s = quant_mxfp4(w.float())
    return q.view(torch.uint8), s.view(torch.uint8)


def quant_mxfp4(w: Tensor, group: int = MXFP4_GROUP) -> tuple[Tensor, Tensor]:
    """float [out, in] -> (int8 [out, in/2] E2M1 pairs, E8M0 scale [out, in/group]); nearest code."""
    out, inp = w.shape
    if inp % group:
        raise QuantFormatError(f"MXFP4 needs the input dim ({inp}) to be a multiple of {group}")
    g = w.float().view(out, inp // group, group)
    e = _pow2_exponent(g.abs().amax(-1), 6.0)
    x = g / torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)[..., None]
    code = (x.abs()[..., None] - E2M1.to(w.device)).abs().argmin(-1)           # nearest magnitude
    code = (code | torch.where(x < 0, 8, 0)).view(out, inp)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, float_to_e8m0(e)
