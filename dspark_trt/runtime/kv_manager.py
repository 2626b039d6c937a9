"""Paged KV-cache bookkeeping: pages per sequence, reserved at admission.

A sequence reserves the pages for its whole budget (prompt + max_new_tokens + the speculative
block) when it is admitted, so a running sequence never runs out of cache; a request that could
never fit is refused before it is queued. Target and draft caches share one page table (the same
positions live at the same page offsets). Rollback is by length: rejected positions are simply
overwritten by the next round.
"""
from __future__ import annotations

import torch


class KVCacheFull(RuntimeError):
    pass


class PagedKVManager:
    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        self.free: list[int] = list(range(num_pages))
        self.owned: dict[int, list[int]] = {}

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
        pages, self.free = self.free[:n], self.free[n:]
        self.owned[seq_id] = pages
        return pages

    def release(self, seq_id: int) -> None:
        self.free.extend(self.owned.pop(seq_id, []))

    def table(self, seq_ids: list[int], device) -> torch.Tensor:
        """[B, max_pages_per_seq] int64 page ids, -1 padded (inert)."""
        rows = [self.owned[s] + [-1] * (self.max_pages_per_seq - len(self.owned[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int64, device=device)
