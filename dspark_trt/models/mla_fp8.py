"""``fp8_ds_mla``: the DeepSeek MLA latent KV row in fp8, as vLLM stores DeepSeek-V4 (584 B a row
at head_dim 512) and as the reference model fake-quantises the latent's NoPE part.

One latent row ``kv [D]`` (``D = nope + rope``) is stored as ``row_bytes(D, rope)`` bytes:

    [0, nope)                     NoPE part in fp8 e4m3, block-scaled
    [nope, nope + S)              one ue8m0 scale byte per block of ``block`` NoPE dims (exponent
                                  + 127, the scale a power of two), zero-padded to 8 bytes
    [nope + S, nope + S + 2 rope) RoPE part in bf16, little-endian, unquantised

V4 (D = 512, rope 64): 448 + 8 + 128 = 584 bytes against 1,024 in bf16. ``block`` is 64 where it
divides the NoPE width (the reference's quantisation group), else the whole NoPE part (tiny test
models). A block's scale is the least power of two with ``amax / scale <= 448``; the fp8 value is
``x / scale`` rounded to nearest e4m3. Decoding multiplies back: exact for the RoPE part, within
e4m3 rounding (2^-4 relative, power-of-two scale) for NoPE.
"""
from __future__ import annotations

import torch
from torch import Tensor

FORMAT = "fp8_ds_mla"
E4M3_MAX = 448.0
BLOCK = 64


def nope_block(nope: int) -> int:
    return BLOCK if nope % BLOCK == 0 else nope


def scale_bytes(nope: int) -> int:
    return -(-(nope // nope_block(nope)) // 8) * 8


def row_bytes(dim: int, rope: int) -> int:
    """Bytes of one latent row of width ``dim`` with ``rope`` RoPE dims (584 for 512 / 64)."""
    nope = dim - rope
    if nope <= 0 or rope <= 0 or nope % 8:
        raise ValueError(f"{FORMAT}: the latent needs NoPE (a multiple of 8) and RoPE dims, got dim "
                         f"{dim}, rope {rope}")
    return nope + scale_bytes(nope) + 2 * rope


def pack(kv: Tensor, rope: int) -> Tensor:
    """kv [..., D] (any float dtype) -> uint8 [..., row_bytes(D, rope)]."""
    D = kv.shape[-1]
    nope = D - rope
    blk, S = nope_block(nope), scale_bytes(nope)
    x = kv[..., :nope].float().unflatten(-1, (nope // blk, blk))                  # [..., nb, blk]
    amax = x.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)               # [..., nb]
    q = (x / torch.exp2(exp)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = torch.zeros(*kv.shape[:-1], S, dtype=torch.uint8, device=kv.device)
    scales[..., : nope // blk] = (exp + 127).to(torch.uint8)
    rope_bytes = kv[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [..., 2 rope]
    return torch.cat([q.flatten(-2).view(torch.uint8), scales, rope_bytes], -1)


def unpack(rows: Tensor, dim: int, rope: int, dtype: torch.dtype) -> Tensor:
    """uint8 [..., row_bytes(dim, rope)] -> [..., dim] in ``dtype`` (an all-zero row: zeros)."""
    if rows.shape[-1] != row_bytes(dim, rope):
        raise ValueError(f"{FORMAT}: rows of {rows.shape[-1]} bytes, expected {row_bytes(dim, rope)} "
                         f"for dim {dim}, rope {rope}")
    nope = dim - rope
    blk, S = nope_block(nope), scale_bytes(nope)
    # in ``dtype`` directly: an e4m3 value times a power of two is exact in bf16 / fp16's range
    # and wider, so no fp32 temporaries (the decoded rows are the attention read's transient)
    q = rows[..., :nope].contiguous().view(torch.float8_e4m3fn).to(dtype).unflatten(-1, (nope // blk, blk))
    scale = torch.exp2(rows[..., nope: nope + nope // blk].float() - 127.0).to(dtype)
    r = rows[..., nope + S:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([(q * scale[..., None]).flatten(-2), r], -1)


def attention_rows(rows: Tensor, idx: Tensor, dim: int, rope: int, dtype: torch.dtype,
                   gather: bool | None = None) -> tuple[Tensor, Tensor]:
    """What a sparse MLA attention reads from an fp8 cache ``rows`` [R, row_bytes] for its index
    list ``idx`` [N, K] (-1 skip) -> (kv [M, dim] in ``dtype``, the index list into it [N, K]).
    ``gather`` (default: when N * K < R) decodes only the rows named, one per index entry (decode
    steps: a few queries); else the whole cache is decoded once and ``idx`` kept (prefill: many
    queries share rows). Either way at most min(N * K, R) rows of ``dim`` in ``dtype`` exist at
    once: at most one layer's cache at the model's dtype, a transient the KV budget (sized in fp8
    rows) does not count."""
    if gather is None:
        gather = idx.numel() < rows.shape[0]
    if not gather:
        return unpack(rows, dim, rope, dtype), idx
    kv = unpack(rows[idx.clamp(min=0).long()], dim, rope, dtype)                  # [N, K, dim]
    pos = torch.arange(idx.numel(), device=idx.device, dtype=idx.dtype).view(idx.shape)
    return kv.view(-1, dim), torch.where(idx >= 0, pos, -1)
