"""dspark::kv_cache_write — write K/V rows into a persistent cache, in place.

Cache layout: ``[num_slots + 1, max_len, Hkv, D]``; a sequence owns one slot (row). The last row is
the *pad row*: inert rows (slot < 0 or position < 0) are routed there by the reference (so the
write needs no data-dependent shape) and skipped by kernels; nothing ever reads it.
"""
from __future__ import annotations

import torch
from torch import Tensor


def write_indices(cache: Tensor, slots: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """[B] slots, [B, T] positions -> ([B, T] slot index, [B, T] position index), inert -> pad row."""
    pad = cache.shape[0] - 1
    valid = (slots[:, None] >= 0) & (positions >= 0)
    if positions.numel() and bool((positions >= cache.shape[1]).any()):
        raise IndexError(f"KV position {int(positions.max())} does not fit a cache of length "
                         f"{cache.shape[1]}")
    row = torch.where(valid, slots[:, None].expand_as(positions), pad)
    col = torch.where(valid, positions, 0)
    return row, col


def kv_cache_write_ref(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor,
                       positions: Tensor) -> None:
    """k, v: [B, T, Hkv, D] -> k_cache[slot, pos] = k (inert rows write the pad row only)."""
    row, col = write_indices(k_cache, slots, positions)
    k_cache.index_put_((row, col), k.to(k_cache.dtype))
    v_cache.index_put_((row, col), v.to(v_cache.dtype))


@torch.library.custom_op("dspark::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor,
                   positions: Tensor) -> None:
    kv_cache_write_ref(k_cache, v_cache, k, v, slots, positions)


@kv_cache_write.register_fake
def _(k_cache, v_cache, k, v, slots, positions) -> None:
    return None
