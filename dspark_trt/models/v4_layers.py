"""DeepSeek-V4 building blocks: interleaved RoPE (optionally YaRN-scaled), weightless RMS, flat
cache rows through a block table.

Cache addressing: a per-layer cache is ``[num_pages + 1, page, D]``; its flat row for position p
of batch row b is ``block_table[b, p // page] * page + p % page`` (the op convention of
``dspark::noncausal_swa_indices``); the last page is the pad page that inert writes land on.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def rms(x: Tensor, eps: float) -> Tensor:
    """RMS normalisation without a weight (V4's per-head query norm)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(rope_dim: int, theta: float, yarn=None, device=None) -> Tensor:
    """[rope_dim / 2] float64 frequencies on ``device``; YaRN blends interpolated (/factor) and
    original ones over the correction range of dims (DeepSeek's ``precompute_freqs_cis``, no mscale)."""
    freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim)
    if yarn is None or yarn.factor == 1.0 or yarn.original_max_position_embeddings <= 0:
        return freq

    def corr_dim(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    return freq / yarn.factor * ramp + freq * (1 - ramp)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [...] (negative treated as 0) -> cos, sin [..., rope_dim / 2]."""
    ang = positions.clamp(min=0).to(torch.float64)[..., None] * inv_freq.to(positions.device)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_tail(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` dims of x in interleaved pairs (2i, 2i+1).

    cos/sin broadcast against x[..., :rope/2] after inserting head dims by the caller.
    ``inverse`` rotates by the negative angle (V4's de-rotation of the attention output).
    """
    rd = 2 * cos.shape[-1]
    nope, r = x[..., :-rd], x[..., -rd:]
    re, im = r[..., 0::2], r[..., 1::2]
    s = -sin if inverse else sin
    out = torch.stack([re * cos - im * s, re * s + im * cos], -1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], -1)


def check_rows(block_table: Tensor, **rows: Tensor) -> None:
    """Every tensor in ``rows`` must share the leading dims of the first ([B, T] or [B]), and
    ``block_table`` must be [B, P]."""
    (first, ref), *rest = rows.items()
    for name, t in rest:
        if t.shape[:ref.dim()] != ref.shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match {first} {tuple(ref.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != ref.shape[0]:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [B={ref.shape[0]}, pages]")


def same_rows(like: Tensor, t: Tensor) -> Tensor:
    """A copy of ``t`` [B, T] sized by ``like`` [B, T, ...] (equal sizes, checked by the caller).

    Under ``torch.export`` each input's batch/token size is its own symbol until the end, and a
    merged ``B * T`` of one input split into the other's ``(B, T)`` guards on ``T > 1``. Deriving
    every index tensor from the same sizes as the activations avoids that (a few int64s copied).
    """
    return torch.empty(like.shape[:t.dim()], dtype=t.dtype, device=t.device).copy_(t)


def flat_rows(block_table: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """block_table [B, P], positions [B, T] -> flat cache rows [B, T] int64, -1 where inert
    (negative position, negative page id, or beyond the table)."""
    col = positions.clamp(min=0) // page_size
    inside = (positions >= 0) & (col < block_table.shape[1])
    page = block_table.gather(1, col.clamp(max=block_table.shape[1] - 1))
    rows = page * page_size + positions.clamp(min=0) % page_size
    return torch.where(inside & (page >= 0), rows, -1)


def write_rows(cache: Tensor, rows: Tensor, values: Tensor) -> None:
    """cache [pages + 1, page, D] <- values [..., D] at flat rows [...] (-1: the pad page)."""
    flat = cache.view(-1, cache.shape[-1])
    pad = (cache.shape[0] - 1) * cache.shape[1]
    flat.index_put_((torch.where(rows >= 0, rows, pad).reshape(-1),),
                    values.reshape(-1, values.shape[-1]).to(cache.dtype))


def read_rows(cache: Tensor, rows: Tensor) -> Tensor:
    """cache [pages + 1, page, D], rows [...] -> [..., D] (rows -1 read as zeros)."""
    flat = cache.view(-1, cache.shape[-1])
    out = flat[rows.clamp(min=0)]
    return torch.where((rows >= 0)[..., None], out, 0)
