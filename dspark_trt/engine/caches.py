"""The engine's KV-cache layout: flat cache tensors described by shape at ``num_pages`` pages.

The builder measures a model's layout (``cache_layout``) into the manifest; the runtime allocates
the caches from it (``allocate_caches``) and hands them to the compiled networks, which write them
in place. ``cache_spec``: the pytree structure that turns the flat list back into the model's cache.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree


def cache_layout(module: nn.Module, page_size: int, dtype: torch.dtype) -> list[dict]:
    """Per flat cache tensor: shape at ``num_pages`` = base + pages_coef * num_pages, and dtype.

    Measured by building the cache on the meta device for 1 and 2 pages, so any cache layout
    (paged per layer, compressed, ...) is described without knowing the model.
    """
    one, _ = pytree.tree_flatten(module.make_cache(1, page_size, dtype, "meta"))
    two, _ = pytree.tree_flatten(module.make_cache(2, page_size, dtype, "meta"))
    out = []
    for a, b in zip(one, two):
        coef = [y - x for x, y in zip(a.shape, b.shape)]
        out.append({"base": [x - c for x, c in zip(a.shape, coef)], "pages_coef": coef,
                    "dtype": str(a.dtype).removeprefix("torch.")})
    return out


def allocate_caches(layout: list[dict], num_pages: int, device) -> list[Tensor]:
    """Zeroed flat caches for ``num_pages`` pages (plus whatever pad rows the layout has)."""
    return [torch.zeros([b + c * num_pages for b, c in zip(d["base"], d["pages_coef"])],
                        dtype=getattr(torch, d["dtype"]), device=device) for d in layout]


def cache_spec(module: nn.Module, page_size: int, dtype: torch.dtype):
    return pytree.tree_flatten(module.make_cache(1, page_size, dtype, "meta"))[1]
