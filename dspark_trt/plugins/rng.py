"""Counter-based random numbers keyed by (request seed, absolute position, stream).

Every random number of the draft-verify loop comes from here, so the reference path and the
Triton kernels draw the same numbers, padded graph rows cannot disturb live ones, and the draft
noise is independent of the acceptance and residual noise (distinct stream ids).

The hash is murmur3's 32-bit finaliser, applied on 64-bit integers masked to 32 bits (a Triton
kernel does the same on ``tl.uint32``). ``u = (h >> 8 + 0.5) / 2**24`` lies strictly in (0, 1).
"""
from __future__ import annotations

import torch

STREAM_DRAFT = 1      # Gumbel noise of the Markov sampler
STREAM_ACCEPT = 2     # acceptance uniforms of rejection sampling
STREAM_RESIDUAL = 3   # residual resample and bonus token (and autoregressive sampling)

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
C1, C2 = 0x85EBCA6B, 0xC2B2AE35
# The torch side multiplies by these constants' int32 twins (C - 2**32: same low 32 bits) and
# reduces mod 2**32 with shifts, so compilers that type integer literals as int32 (inductor's Triton
# code) accept it; the results are identical.
_GOLDEN_S, _C1_S, _C2_S = GOLDEN - 2**32, C1 - 2**32, C2 - 2**32


def low32(x: torch.Tensor) -> torch.Tensor:
    """x mod 2**32 for int64 x (arithmetic shift floors, so negative x lands in [0, 2**32))."""
    return x - ((x >> 32) << 32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding uint32 values."""
    x = low32(x)
    x = x ^ (x >> 16)
    x = low32(x * _C1_S)
    x = x ^ (x >> 13)
    x = low32(x * _C2_S)
    x = x ^ (x >> 16)
    return x


def row_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """[B] int64 seeds and positions -> [B] uint32 keys (as int64)."""
    seed = seed.to(torch.int64)
    k = mix32(low32(seed) + low32(seed >> 32) * _GOLDEN_S + stream * _C1_S)
    return mix32(k ^ low32(position.to(torch.int64)))


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B] seeds, [B] positions -> [B, n] float32 uniforms in (0, 1), one per vocabulary entry."""
    key = row_key(seed, position, stream)                                   # [B]
    idx = torch.arange(n, device=key.device, dtype=torch.int64)
    h = mix32(key[:, None] ^ low32(idx[None, :] * _GOLDEN_S))              # [B, n]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def gumbel(seed: torch.Tensor, position: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B, n] standard Gumbel noise: ``argmax(logits + g)`` samples ``softmax(logits)``."""
    return -torch.log(-torch.log(uniform(seed, position, stream, n)))
