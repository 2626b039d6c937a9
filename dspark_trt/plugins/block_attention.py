"""dspark::block_attention — GQA attention of a block of queries against a slot KV cache.

Query ``t`` of row ``b`` sees cache positions ``[0, kv_limit[b, t]]`` of slot ``slots[b]``:
``kv_limit = positions`` is causal (target prefill / verify); ``kv_limit = P + N - 1`` for every
query of a draft block is the DSpark non-causal block (whole context + whole block). Inert queries
(slot < 0 or position < 0) return zeros.
"""
from __future__ import annotations

import torch
from torch import Tensor


def block_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                        positions: Tensor, kv_limit: Tensor, scale: float) -> Tensor:
    """q [B, T, H, D]; caches [S+1, L, Hkv, D]; slots [B]; positions, kv_limit [B, T] -> [B, T, H, D]."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = (slots[:, None] >= 0) & (positions >= 0) & (kv_limit >= 0)        # [B, T]
    limit = torch.where(valid, kv_limit, 0)
    rows = slots.clamp(min=0)
    k = k_cache[rows].to(acc)                                                   # [B, L, Hkv, D]
    v = v_cache[rows].to(acc)
    qg = q.to(acc).reshape(B, T, Hkv, H // Hkv, D)
    scores = torch.einsum("bthgd,bshd->bthgs", qg, k) * scale                  # [B, T, Hkv, g, L]
    key_pos = torch.arange(k.shape[1], device=q.device)
    visible = key_pos[None, None, :] <= limit[:, :, None]                        # [B, T, L]
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    out = torch.einsum("bthgs,bshd->bthgd", scores.softmax(-1), v).reshape(B, T, H, D)
    return torch.where(valid[:, :, None, None], out, 0.0).to(q.dtype)


@torch.library.custom_op("dspark::block_attention", mutates_args=())
def block_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                    kv_limit: Tensor, scale: float) -> Tensor:
    return block_attention_ref(q, k_cache, v_cache, slots, positions, kv_limit, scale)


@block_attention.register_fake
def _(q, k_cache, v_cache, slots, positions, kv_limit, scale):
    return torch.empty_like(q)
