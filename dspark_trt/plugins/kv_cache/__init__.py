"""dspark::kv_cache_write — write K/V rows into a paged KV cache, in place.

Cache layout ``[num_pages + 1, page_size, Hkv, D]``. Row b's token at position p lives in page
``block_table[b, p // page_size]`` at offset ``p % page_size``. The last page is the *pad page*:
inert rows (position < 0 or a negative page id) are routed there by the reference (so the write
needs no data-dependent shape) and skipped by kernels; nothing ever reads it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import use_triton
from ..opspec import AotDesc, OnnxNode, OpSpec


def page_coords(cache: Tensor, block_table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[B, P] table, [B, T] positions -> (page [B, T], offset [B, T], valid [B, T])."""
    page_size = cache.shape[1]
    col = (positions.clamp(min=0) // page_size).clamp(max=block_table.shape[1] - 1)
    page = block_table.gather(1, col)
    valid = (positions >= 0) & (page >= 0) & (positions < block_table.shape[1] * page_size)
    return page, positions.clamp(min=0) % page_size, valid


def kv_cache_write_ref(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                       positions: Tensor) -> None:
    """k, v [B, T, Hkv, D] -> cache[page(b, p), p % page_size] (inert rows hit the pad page only)."""
    page, off, valid = page_coords(k_cache, block_table, positions)
    page = torch.where(valid, page, k_cache.shape[0] - 1)
    k_cache.index_put_((page, off), k.to(k_cache.dtype))
    v_cache.index_put_((page, off), v.to(v_cache.dtype))


def gather_pages(cache: Tensor, block_table: Tensor) -> Tensor:
    """[num_pages + 1, page, ...] cache, [B, P] table -> [B, P * page, ...] (negative ids read the pad page)."""
    pages = torch.where(block_table >= 0, block_table, cache.shape[0] - 1)
    g = cache[pages]                                                            # [B, P, page, ...]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


@torch.library.triton_op("dspark::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                   positions: Tensor) -> None:
    if use_triton(k_cache):
        from ..kernels.kv_cache import kv_cache_write_triton
        kv_cache_write_triton(k_cache, v_cache, k, v, block_table, positions)
    else:
        kv_cache_write_ref(k_cache, v_cache, k, v, block_table, positions)


def kv_cache_update_ref(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                        positions: Tensor) -> tuple[Tensor, Tensor]:
    """Functional form (returns updated copies); what the ONNX node ``dspark::kv_cache_write`` means."""
    k_new, v_new = k_cache.clone(), v_cache.clone()
    kv_cache_write_ref(k_new, v_new, k, v, block_table, positions)
    return k_new, v_new


@torch.library.custom_op("dspark::kv_cache_update", mutates_args=())
def kv_cache_update(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                    positions: Tensor) -> tuple[Tensor, Tensor]:
    """Functional twin of ``kv_cache_write`` for ONNX export (ONNX has no in-place update): it exports
    as the node ``kv_cache_write`` whose outputs are the updated caches (TensorRT aliases them to
    the cache inputs)."""
    k_new, v_new = k_cache.clone(), v_cache.clone()
    kv_cache_write(k_new, v_new, k, v, block_table, positions)
    return k_new, v_new


@kv_cache_update.register_fake
def _(k_cache, v_cache, k, v, block_table, positions):
    return torch.empty_like(k_cache), torch.empty_like(v_cache)


OPS = (
    OpSpec("kv_cache_write", kv_cache_write_ref, triton="kernels.kv_cache:kv_cache_write_triton",
           onnx=OnnxNode((("k_cache", "T"), ("v_cache", "T"), ("k", "T"), ("v", "T"), ("block_table", "I"),
                          ("positions", "I")),
                         (("k_cache_out", "T"), ("v_cache_out", "T"))),
           functional="kv_cache_update",
           aot=AotDesc(("T", "T", "T", "T", torch.int64, torch.int64), ("T", "P", "PAGE_SIZE", "ROW"),
                       ("T", "T"), {"BLOCK": 1024}),
           tensorrt=True, export_safe=True),
    OpSpec("kv_cache_update", kv_cache_update_ref,
           reference_reason="functional twin of kv_cache_write for ONNX export; AOTI networks "
                            "write caches in place with kv_cache_write"),
)
