"""The draft's context of independent rows, in one call or one CUDA graph (issue #25).

``DeferredContext.flush`` writes a batch's pending draft context: the rows that the AR fallback's
rounds left (and prompts deferred during a streak). Each row's write depends only on its taps, its
position and its sequence's page table (``ctx = hidden_norm(fc(taps))`` and every draft layer's
K/V at that position: no attention), so the rows go flat, ``[R]``, each with the index of its
sequence's table row, instead of ``[b, L]`` padded to the longest slot.

Eagerly through the modules the write was about 65 launches for the default pair (fc, norm, RoPE,
then K/V, norm, RoPE and the cache write of every layer; with the row kernels, since session 43,
about 8: ``Qwen3Attention.context_cache``): ~2 ms of host time on the H100 lent in session 42, where a
speculative round after an AR streak took 2.64 ms against a fixed round's 0.64. With
``capture`` (``GraphedSteps``) a write of up to ``ROW_BUCKETS[-1]`` rows replays one graph per row
bucket ``M`` instead, over static buffers: ``rows [M_max, m*d]`` (the taps, which the caller puts
there: ``rows``), ``meta [2, M_max]`` (positions, table row) and ``table [slots, pages]``; pad rows
sit at position -1 and write nothing. ``GraphedSteps.capture`` captures every bucket where the
scheduler may fall back (``capture_all``), else a bucket is captured on first use; each capture
runs on inert rows only. Longer writes run eagerly: their kernels, not the host, take the time.

Networks with a batch cap (``max_batch_size``: a compiled engine's exported batch dimension is
bounded) take no flat rows past it and no graphs: their writes go as ``[b, L]``, each sequence's
rows in its own row (``_write_padded``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PADDED_COLUMNS = 512       # a capped network's write: [b, <= this] per call (``_write_padded``)


def row_bucket(R: int) -> int | None:
    """The smallest bucket of at least R rows, or None (an eager write)."""
    return next((m for m in ROW_BUCKETS if m >= R), None)


class ContextRows:
    """``write(rows, positions, table_rows, table)``: the draft context of R independent rows,
    eager, or from graphs made by ``capture(fn)`` (a ``CapturedGraph``) where given. Networks
    with a batch cap (``max_batch_size``: compiled engines, whose exported batch dimension is
    bounded) take the rows as ``[b, L]`` per sequence instead, ``PADDED_COLUMNS`` at a time, and
    no graphs."""

    def __init__(self, nets, capture: Callable[[Callable[[], Tensor]], object] | None = None,
                 slots: int = 0, pages: int = 0):
        self.nets, self.slots, self.pages = nets, slots, pages
        self.row_cap = getattr(nets, "max_batch_size", None)
        self.capture = capture if self.row_cap is None else None
        self._rows: Tensor | None = None            # [ROW_BUCKETS[-1], m*d] the graphs' taps
        self._meta: Tensor | None = None            # [2, ROW_BUCKETS[-1]] int64: positions, table rows
        self._table: Tensor | None = None           # [slots, pages] int64
        self._graphs: dict[int, object] = {}        # bucket -> captured graph
        self.graph_writes = self.eager_writes = 0

    def rows(self, R: int, like: Tensor) -> Tensor:
        """[R, m*d] where the caller puts the taps of the next ``write`` (dtype and width of
        ``like``): a view of the graphs' static rows when a graph takes R rows."""
        width = like.shape[-1]
        if self.capture is None or row_bucket(R) is None:
            return like.new_empty(R, width)
        if self._rows is None or self._rows.shape[-1] != width or self._rows.dtype != like.dtype:
            M = ROW_BUCKETS[-1]
            self._graphs.clear()                    # (graphs read the buffers they were captured on)
            self._rows = like.new_zeros(M, width)
            self._meta = torch.zeros(2, M, dtype=torch.int64, device=like.device)
            self._table = torch.full((max(self.slots, 1), self.pages), -1, dtype=torch.int64, device=like.device)
        return self._rows[:R]

    def capture_all(self, like: Tensor) -> None:
        """Capture every bucket's graph now (``GraphedSteps.capture``, where the scheduler may fall
        back: otherwise a flush's first use of a bucket captures it inside a round)."""
        if self.capture is not None:
            self.rows(1, like)
            for M in ROW_BUCKETS:
                if M not in self._graphs:
                    self._capture(M)

    def write(self, rows: Tensor, positions: np.ndarray, table_rows: np.ndarray, table: Tensor) -> None:
        """The context of ``rows [R, m*d]`` (from ``rows(R, ...)``) at ``positions [R]`` of the
        sequences whose page tables are ``table[table_rows] [R, pages]``."""
        R = rows.shape[0]
        graphed = (self._rows is not None and rows.data_ptr() == self._rows.data_ptr()
                   and table.shape[0] <= self._table.shape[0] and table.shape[1] == self.pages)
        if not graphed:
            self.eager_writes += 1
            if self.row_cap is not None and R > self.row_cap:
                return self._write_padded(rows, positions, table_rows, table)
            dev = rows.device
            pos = torch.from_numpy(positions).to(dev)
            self.nets.draft_context(rows[:, None], pos[:, None], table[torch.from_numpy(table_rows).to(dev)])
            return
        M = row_bucket(R)
        graph = self._graphs.get(M) or self._capture(M)
        meta = np.zeros((2, M), dtype=np.int64)
        meta[0, R:] = -1                                          # pad rows: inert
        meta[0, :R], meta[1, :R] = positions, table_rows
        with torch.inference_mode():
            self._meta[:, :M].copy_(torch.from_numpy(meta))
            self._table[: table.shape[0]].copy_(table)
        graph.launch()
        self.graph_writes += 1

    def _write_padded(self, rows: Tensor, positions: np.ndarray, table_rows: np.ndarray, table: Tensor) -> None:
        """The rows as ``[b, L]``, each sequence's in its table row (pad: position -1), written
        ``PADDED_COLUMNS`` columns per call."""
        b, R = table.shape[0], rows.shape[0]
        counts = np.bincount(table_rows, minlength=b)
        order = np.argsort(table_rows, kind="stable")
        col = np.empty(R, dtype=np.int64)
        col[order] = np.arange(R) - np.repeat(np.cumsum(counts) - counts, counts)      # within its sequence
        L = int(counts.max())
        pos = np.full((b, L), -1, dtype=np.int64)
        src = np.full((b, L), R, dtype=np.int64)                 # row R: a zero row for the pads
        pos[table_rows, col], src[table_rows, col] = positions, np.arange(R)
        dev = rows.device
        padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        pos_t, src_t = torch.from_numpy(pos).to(dev), torch.from_numpy(src).to(dev)
        for c in range(0, L, PADDED_COLUMNS):
            cols = slice(c, c + PADDED_COLUMNS)
            self.nets.draft_context(padded[src_t[:, cols]], pos_t[:, cols], table)

    def _capture(self, M: int):
        """The graph of bucket M, captured with every row inert (its warm-up and first replay
        write nothing to the cache)."""
        with torch.inference_mode():
            self._meta[0].fill_(-1)
        rows, meta, table = self._rows[:M], self._meta[:, :M], self._table

        def fn() -> Tensor:
            pos = meta[0]
            self.nets.draft_context(rows[:, None], pos[:, None], table[meta[1]])
            return pos
        self._graphs[M] = self.capture(fn)
        return self._graphs[M]
