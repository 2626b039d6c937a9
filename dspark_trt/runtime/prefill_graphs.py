"""CUDA graphs of the admission prefill, one per padded shape (``GraphedSteps.prefill``).

An eager prefill is bound by the host: the target's ~25 launches per layer cost about as much
Python as the kernels take on the GPU (H200 at 969bcce, Qwen3-8B dims: 40-60 ms per admission of
one to three 128-token prompts, 40-70 % of a steady load's time in every verify mode). The
prefill is a fixed-shape function once padded: prompts right-padded to a length bucket ``Tb``
(``PREFILL_LENGTHS``) and rows to a batch bucket ``Bb``, pad tokens at position -1 and pad rows
with no pages, which write nothing and read nothing (the eager prefill pads the same way, to the
longest prompt). So each (Bb, Tb) gets one graph of ``DecodeSteps.prefill_step`` over its own
static buffers, captured on first use on inert inputs (the warm-up writes no cache) and replayed
after four small copies into the buffers. The graph returns the last prompt row's logits only
[Bb, V] (and, for a prefill whose draft context waits, ``keep_taps``, the taps [Bb, Tb, m*d]); its
[Bb, Tb, V] logits are a temporary of the shared pool. Shapes past
``PREFILL_MAX_TOKENS`` (Bb * Tb) run eagerly: they are long enough that the kernels, not the
host, take the time.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_MAX_TOKENS = 2048            # Bb * Tb: the largest graph (its logits temporary: Tb x V)


def length_bucket(T: int) -> int | None:
    return next((t for t in PREFILL_LENGTHS if t >= T), None)


class PrefillBuffers:
    """Static inputs of one prefill graph, inert until filled: tokens 0, positions -1, pages -1."""

    def __init__(self, Bb: int, Tb: int, pages: int, device):
        z = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(Bb, Tb, **z)
        self.positions = torch.full((Bb, Tb), -1, **z)
        self.table = torch.full((Bb, pages), -1, **z)
        self.lens = torch.ones(Bb, **z)

    def fill(self, tokens: Tensor, positions: Tensor, table: Tensor, lens: Tensor) -> None:
        B, T = tokens.shape
        self.tokens.zero_()
        self.positions.fill_(-1)
        self.table.fill_(-1)
        self.lens.fill_(1)
        self.tokens[:B, :T].copy_(tokens)
        self.positions[:B, :T].copy_(positions)
        self.table[:B].copy_(table)
        self.lens[:B].copy_(lens)


class PrefillGraphs:
    """The prefill graphs of a ``GraphedSteps`` (its steps, batch buckets and table width);
    ``capture(fn)`` makes a ``CapturedGraph`` of fn in the decode graphs' pool and stream."""

    def __init__(self, graphed, capture: Callable[[Callable[[], Tensor]], object]):
        self.g, self._capture = graphed, capture
        self._graphs: dict[tuple[int, int, bool, bool], tuple[object, PrefillBuffers]] = {}

    def shape(self, B: int, T: int, pages: int) -> tuple[int, int] | None:
        """(Bb, Tb) of a prefill of B prompts of at most T tokens, or None: it runs eagerly."""
        Tb = length_bucket(T)
        if Tb is None or B > self.g.buckets[-1] or pages != self.g.max_pages:
            return None
        Bb = self.g.bucket(B)
        return (Bb, Tb) if Bb * Tb <= PREFILL_MAX_TOKENS else None

    def graph(self, Bb: int, Tb: int, context: bool, keep_taps: bool = False):
        """(the captured graph, its buffers) of shape (Bb, Tb) (captured on first use)."""
        key = (Bb, Tb, context, keep_taps)
        if key not in self._graphs:
            buf = PrefillBuffers(Bb, Tb, self.g.max_pages, self.g.device)
            steps = self.g.steps
            fn: Callable[[], Tensor] = lambda: steps.prefill_step(  # noqa: E731
                buf.tokens, buf.positions, buf.table, buf.lens, context, keep_taps)
            self._graphs[key] = (self._capture(fn), buf)
        return self._graphs[key]

    def run(self, tokens: Tensor, positions: Tensor, table: Tensor, lens: Tensor, context: bool,
            keep_taps: bool = False):
        """As ``DecodeSteps.prefill``: the last prompt row's logits [B, V] (``keep_taps``: and the
        taps [B, T, m*d]), views of the graph's outputs, valid until its next replay."""
        B, T = tokens.shape
        shape = self.shape(B, T, table.shape[1])
        if shape is None:
            return self.g.steps.prefill_step(tokens, positions, table, lens, context, keep_taps)
        graph, buf = self.graph(*shape, context, keep_taps)
        with torch.inference_mode():
            buf.fill(tokens, positions, table, lens)
        graph.launch()
        if keep_taps:
            last, taps = graph.outputs
            return last[:B], taps[:B, :T]
        return graph.outputs[:B]

    def capture(self, batch_sizes: list[int], lengths: list[int], context: bool,
                keep_taps: bool = False) -> None:
        """Capture the graphs of these prefill shapes now (a server's common admissions)."""
        for B in batch_sizes:
            for T in lengths:
                shape = self.shape(B, T, self.g.max_pages)
                if shape is not None:
                    self.graph(*shape, context, keep_taps)
