"""dspark::block_attention — GQA attention of a block of queries against a paged KV cache.

Query ``t`` of row ``b`` sees positions ``[0, kv_limit[b, t]]`` of its sequence (pages from
``block_table[b]``): ``kv_limit = positions`` is causal (target prefill / verify);
``kv_limit = P + N - 1`` for every query of a draft block is the DSpark non-causal block (whole
context + whole block). Inert queries (position < 0, or a row whose first page id is negative)
return zeros.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..dispatch import use_triton
from ..kv_cache import gather_pages
from ..opspec import AotDesc, OnnxNode, OpSpec


def block_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                        positions: Tensor, kv_limit: Tensor, scale: float) -> Tensor:
    """q [B, T, H, D]; caches [pages+1, page, Hkv, D]; block_table [B, P]; positions, kv_limit [B, T]
    -> [B, T, H, D]."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = (block_table[:, :1] >= 0) & (positions >= 0) & (kv_limit >= 0)    # [B, T]
    limit = torch.where(valid, kv_limit, 0)
    k = gather_pages(k_cache, block_table).to(acc)                              # [B, L, Hkv, D]
    v = gather_pages(v_cache, block_table).to(acc)
    qg = q.to(acc).reshape(B, T, Hkv, H // Hkv, D)
    scores = torch.einsum("bthgd,bshd->bthgs", qg, k) * scale                  # [B, T, Hkv, g, L]
    key_pos = torch.arange(k.shape[1], device=q.device)
    visible = key_pos[None, None, :] <= limit[:, :, None]                        # [B, T, L]
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    out = torch.einsum("bthgs,bshd->bthgd", scores.softmax(-1), v).reshape(B, T, H, D)
    return torch.where(valid[:, :, None, None], out, 0.0).to(q.dtype)


def kernel_supports_head_dim(D: int) -> bool:
    """The Triton kernel's ``tl.dot`` needs a power-of-two head dim >= 16 (tiny test models with
    D = 8 run the reference instead of failing to compile)."""
    return D >= 16 and D & (D - 1) == 0


@torch.library.triton_op("dspark::block_attention", mutates_args=())
def block_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    positions: Tensor, kv_limit: Tensor, scale: float) -> Tensor:
    if use_triton(q) and kernel_supports_head_dim(q.shape[-1]):
        from ..kernels.block_attention import block_attention_triton
        return block_attention_triton(q, k_cache, v_cache, block_table, positions, kv_limit, scale)
    return block_attention_ref(q, k_cache, v_cache, block_table, positions, kv_limit, scale)


class SlotGroups(NamedTuple):
    """Packed query rows grouped back into their batch rows (``grouped_block_attention``)."""
    block_table: Tensor     # [B, P] the batch rows' pages
    positions: Tensor       # [B, T] position of token (b, t), -1: no token
    q_index: Tensor         # [B, T] int32 packed row of token (b, t), -1: no token


def grouped_block_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                            positions: Tensor, q_index: Tensor, scale: float) -> Tensor:
    """``block_attention`` of packed query rows grouped by batch row: q [R, 1, H, D] (R packed rows);
    block_table [B, P]; positions [B, T] (the causal limit too; -1: no token); q_index [B, T] the
    packed row of token (b, t), -1 where its position is -1 -> [R, 1, H, D], rows no token names
    zero. What the packed verify's slots need (``runtime/packed_verify.py``): a row's cache is read
    once for all of its slots, as the rectangular verify reads it. Not an exported op: the runtime's
    eager / CUDA-graphed steps call it."""
    if use_triton(q) and kernel_supports_head_dim(q.shape[-1]):
        from ..kernels.block_attention import block_attention_triton
        return block_attention_triton(q, k_cache, v_cache, block_table, positions, positions, scale,
                                      q_index=q_index)
    rows = q.reshape(-1, *q.shape[-2:])                                           # [R, H, D]
    R = rows.shape[0]
    live = q_index >= 0
    window = rows[q_index.clamp(min=0)]                                           # [B, T, H, D]
    pos = torch.where(live, positions, -1)
    o = block_attention_ref(window, k_cache, v_cache, block_table, pos, pos, scale)   # 0 where not live
    out = rows.new_zeros(R + 1, *rows.shape[1:])          # row R: where the tokens without a row go
    out.index_copy_(0, torch.where(live, q_index, R).flatten().long(), o.flatten(0, 1))   # no host sync
    return out[:R].view(q.shape)


def _aot_constants() -> dict:
    from ..kernels.block_attention import ATTN_DEFAULTS
    return {"SCALE": 128 ** -0.5, "H": 32, "HKV": 8, "D": 128, "BLOCK_T": 8, "BLOCK_N": 64,
            "PREFETCH": ATTN_DEFAULTS["prefetch"]}


OPS = (
    OpSpec("block_attention", block_attention_ref, triton="kernels.block_attention:block_attention_triton",
           onnx=OnnxNode((("q", "T"), ("k_cache", "T"), ("v_cache", "T"), ("block_table", "I"),
                          ("positions", "I"), ("kv_limit", "I")),
                         (("out", "T"),), {"scale": "float"}),
           aot=AotDesc(("T", "T", "T", torch.int64, torch.int64, torch.int64), ("T", "P", "PAGE_SIZE", "PAD_PAGE"),
                       ("T",), _aot_constants),
           tensorrt=True, export_safe=True),
)
