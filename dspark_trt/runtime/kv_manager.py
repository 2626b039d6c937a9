"""Paged KV-cache bookkeeping: pages per sequence, reserved as the sequence grows.

A sequence reserves pages for what the next round can write (its context + the speculative
block) at admission and grows by ``grow`` before each round; when the free pages run short the
scheduler preempts a sequence (its pages freed, recomputed later: ``scheduler.py``). A request
whose whole budget (prompt + max_new_tokens + the block) could never fit is refused before it is
queued. Target and draft caches share one page table (the same
positions live at the same page offsets). Rollback is by length: rejected positions are simply
overwritten by the next round.
"""
from __future__ import annotations

import logging

import torch

from ..config.v4 import DeepSeekV4Config

log = logging.getLogger(__name__)


class KVCacheFull(RuntimeError):
    pass


class KVBudgetError(ValueError):
    """The KV-cache memory budget cannot hold what was asked of it (raised before any request)."""


def kv_bytes_per_token(pair, dtype: torch.dtype, speculative: bool = True) -> int:
    """K + V bytes one token occupies in the target cache (+ the draft cache) of ``pair``."""
    el = torch.empty((), dtype=dtype).element_size()
    t = pair.target
    n = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * el
    if speculative and pair.draft is not None:
        d = pair.draft.layer_config()
        n += 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * el
    return n


def pages_from_budget(budget_bytes: int, page_size: int, bytes_per_token: int,
                      min_tokens: int) -> int:
    """Pages of ``page_size`` tokens that fit ``budget_bytes`` (the pad page included); raises
    ``KVBudgetError`` when fewer than one sequence of ``min_tokens`` tokens would fit."""
    page_bytes = page_size * bytes_per_token
    pages = int(budget_bytes // page_bytes) - 1               # one pad page per cache
    need = -(-min_tokens // page_size)
    if pages < need:
        raise KVBudgetError(
            f"KV-cache budget of {budget_bytes / 2**30:.3f} GiB holds {max(pages, 0)} pages of "
            f"{page_size} tokens ({page_bytes / 2**20:.2f} MiB each, {bytes_per_token} B/token); one "
            f"sequence of max_seq_len + speculative headroom = {min_tokens} tokens needs {need}: "
            f"raise the budget or lower max_seq_len")
    return pages


def table_width_cost(pair, device) -> str | None:
    """Why a decode step's cost grows with the block-table width (``ceil((max_seq_len + headroom)
    / page_size)`` pages per batch slot) on ``device``, or None where it does not: CUDA's Triton
    block attention reads each sequence only up to its own length, and the tables and CUDA-graph
    input buffers are int64 [batch, width] (8 bytes a page)."""
    if isinstance(pair.target, DeepSeekV4Config):
        return "DeepSeek-V4's compressed attention scores every entry the block table can hold"
    if torch.device(device).type == "cpu":
        return "on a CPU the attention reference reads the whole block table every step"
    return None


def context_that_fits(context: int, num_pages: int, page_size: int, headroom: int,
                      width_cost: str | None = None, short: int = 2048) -> int:
    """The default max_seq_len: the model's ``context`` (at most ``short`` where ``width_cost``
    says a wide block table costs every step), capped to what ``num_pages`` pages hold for one
    sequence with its speculative ``headroom`` (a longer maximum could never be scheduled).
    Either cap is logged with its reason."""
    if width_cost and context > short:
        log.info("max_seq_len %d (the model's context is %d): %s; give max_seq_len for more",
                 short, context, width_cost)
        context = short
    fits = num_pages * page_size - headroom
    if fits >= context:
        return context
    if fits < 1:
        raise KVBudgetError(f"{num_pages} KV pages of {page_size} tokens cannot hold one token plus "
                            f"the speculative headroom of {headroom}: raise the budget")
    log.warning("max_seq_len %d instead of %d tokens (the model's context): the KV cache holds %d "
                "pages of %d tokens (one sequence at most); give max_seq_len, or a larger KV budget "
                "(num_pages, kv_cache_bytes, gpu_memory_utilization), for more", fits, context,
                num_pages, page_size)
    return fits


def device_memory_bytes(device) -> int | None:
    """Total memory of ``device`` (the GPU's, or the host's physical memory for cpu), if known."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_fits(num_pages: int, page_size: int, bytes_per_token: int, device) -> None:
    """``KVBudgetError`` when caches of ``num_pages`` (+ the pad page) exceed the device's memory."""
    need, have = (num_pages + 1) * page_size * bytes_per_token, device_memory_bytes(device)
    if have is not None and need > have:
        raise KVBudgetError(f"KV caches of {num_pages} pages x {page_size} tokens need "
                            f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of "
                            f"{torch.device(device).type} memory: lower max_batch_size or max_seq_len, "
                            "or give num_pages / kv_cache_bytes")


def cuda_kv_budget(device, gpu_memory_utilization: float) -> int:
    """Bytes left for KV caches if the process may use ``gpu_memory_utilization`` of the GPU:
    ``utilization * total - (memory in use now, weights included)``."""
    if not 0 < gpu_memory_utilization <= 1:
        raise KVBudgetError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(gpu_memory_utilization * total - (total - free))


class PagedKVManager:
    """Pages of the paged KV caches per sequence. ``free`` is a stack (the next page at its end;
    pages released last are taken first), so taking or returning n pages costs O(n), not O(free
    pages): a serving budget holds tens of thousands of pages, and a decode round grows several
    sequences by a page."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        self.free: list[int] = list(range(num_pages - 1, -1, -1))     # pages 0, 1, ... taken first
        self.owned: dict[int, list[int]] = {}

    def _take(self, n: int) -> list[int]:
        """The next ``n`` free pages (the caller checked there are), off the stack's end."""
        if n <= 0:
            return []
        pages = self.free[-n:][::-1]
        del self.free[-n:]
        return pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits_ever(self, num_tokens: int) -> bool:
        n = self.pages_for(num_tokens)
        return n <= self.num_pages and n <= self.max_pages_per_seq

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self.free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        n = self.pages_for(num_tokens)
        if n > len(self.free) or n > self.max_pages_per_seq:
            raise KVCacheFull(f"sequence {seq_id} needs {n} pages of {self.page_size} tokens, "
                              f"{len(self.free)} free (per-sequence limit {self.max_pages_per_seq})")
        pages = self._take(n)
        self.owned[seq_id] = pages
        return pages

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extend ``seq_id``'s pages to hold ``num_tokens``; -> the new pages (``KVCacheFull`` if
        there are not enough free pages: nothing taken)."""
        have = self.owned[seq_id]
        n = self.pages_for(num_tokens) - len(have)
        if n <= 0:
            return []
        if n > len(self.free) or len(have) + n > self.max_pages_per_seq:
            raise KVCacheFull(f"sequence {seq_id} needs {n} more pages of {self.page_size} tokens, "
                              f"{len(self.free)} free (per-sequence limit {self.max_pages_per_seq})")
        pages = self._take(n)
        have.extend(pages)
        return pages

    def missing(self, seq_id: int, num_tokens: int) -> int:
        """Pages ``seq_id`` lacks to hold ``num_tokens``."""
        return max(0, self.pages_for(num_tokens) - len(self.owned.get(seq_id, [])))

    def release(self, seq_id: int) -> None:
        self.free.extend(reversed(self.owned.pop(seq_id, [])))    # taken again in the same order

    def table(self, seq_ids: list[int], device) -> torch.Tensor:
        """[B, max_pages_per_seq] int64 page ids, -1 padded (inert)."""
        rows = [self.owned[s] + [-1] * (self.max_pages_per_seq - len(self.owned[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int64, device=device)
