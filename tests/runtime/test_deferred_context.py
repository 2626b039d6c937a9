"""``DeferredContext``: the fallback's AR rows in a pool the sequence slots share."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark_trt.runtime.deferred_context import DeferredContext


class _Steps:
    """What DeferredContext uses of ``DecodeSteps``: ``reserve_taps``, ``tap_store`` and the
    networks' ``draft_context`` (recorded here)."""

    def __init__(self):
        self.calls = []
        self.tap_store = None
        self.nets = SimpleNamespace(
            draft_context=lambda taps, pos, table: self.calls.append((taps.clone(), pos, table)))

    def reserve_taps(self, rows: int) -> None:
        self.tap_store = torch.full((rows + 1, 3), -1.0)


def _store(steps, rows, values):
    steps.tap_store[torch.as_tensor(rows)] = torch.as_tensor(values, dtype=torch.float32)[:, None].expand(-1, 3)


def test_one_slot_holds_the_whole_pool_and_flushes_its_rows_in_order():
    """Slots share slots x capacity rows: slot 0 alone takes all 8 (capacity 2, 4 slots) before a
    flush is due; the flush writes its taps at its positions in the order they came, and the rows
    go back to the pool."""
    steps = _Steps()
    d = DeferredContext(steps, slots=4, capacity=2)
    taken = []
    for p in range(8):
        assert d.room_for([0])
        row = d.add([0], [10 + p])
        _store(steps, row, [100 + p])                    # the AR round stores its taps there
        taken.append(int(row[0]))
    assert len(set(taken)) == 8 and not d.room_for([0]) and d.pending(0) == 8
    with pytest.raises(RuntimeError, match="all held"):
        d.add([0], [18])
    d.flush([0, 1], table=torch.tensor([[3], [4]]))
    taps, pos, table = steps.calls[-1]                   # flat rows, one each: [R, 1, m*d]
    np.testing.assert_array_equal(pos[:, 0].numpy(), np.arange(10, 18))
    assert (table == 3).all()                            # every row slot 0's table row
    torch.testing.assert_close(taps[:, 0, 0], torch.arange(100.0, 108.0))
    assert d.empty and d.room_for([0, 1, 2, 3]) and len(d.free) == 8
    assert d.flushes == 1 and d.flushed_rows == 8


def test_rows_of_several_slots_and_a_prompt_and_a_drop():
    """Interleaved slots keep their own rows in order behind a deferred prompt's; a dropped
    slot's rows return to the pool unwritten."""
    steps = _Steps()
    d = DeferredContext(steps, slots=2, capacity=3)
    d.add_prompt(1, [0, 1], torch.tensor([[7.0] * 3, [8.0] * 3]))
    for p in range(2):
        rows = d.add([0, 1], [5 + p, 2 + p])
        _store(steps, rows, [50 + p, 20 + p])
    d.add([0], [7])
    dropped = d.rows[0][:]
    d.drop(0)
    assert set(dropped) <= set(d.free) and d.pending(0) == 0 and len(d.free) == 4
    d.flush([1], table=torch.tensor([[9]]))
    taps, pos, _ = steps.calls[-1]                       # the AR rows, then the prompt's
    np.testing.assert_array_equal(pos[:, 0].numpy(), [2, 3, 0, 1])
    torch.testing.assert_close(taps[:, 0, 0], torch.tensor([20.0, 21.0, 7.0, 8.0]))
    assert d.empty and len(d.free) == 6


def test_a_flush_writes_only_the_pending_rows():
    """Rows go flat, each with its sequence's table row: after one slot's long streak a wide
    batch's flush writes that streak and the others' rows, no padding, and the pool is free."""
    steps = _Steps()
    d = DeferredContext(steps, slots=4, capacity=2)           # a pool of 8 rows
    for p in range(5):
        _store(steps, d.add([0], [p]), [p])
    _store(steps, d.add([0, 1, 2], [5, 40, 60]), [5, 40, 60])
    assert not d.room_for([0])                                # 8 rows held: none free
    d.flush([2, 0, 1], table=torch.tensor([[12], [10], [11]]))
    taps, pos, table = steps.calls[-1]
    assert taps.shape[:2] == (8, 1)
    np.testing.assert_array_equal(pos[:, 0].numpy(), [60, 0, 1, 2, 3, 4, 5, 40])
    np.testing.assert_array_equal(table[:, 0].numpy(), [12, 10, 10, 10, 10, 10, 10, 11])
    torch.testing.assert_close(taps[:, 0, 0], pos[:, 0].float())
    assert d.empty and len(d.free) == 8 and d.flushed_rows == 8


def test_an_empty_add_takes_no_row():
    d = DeferredContext(_Steps(), slots=2, capacity=2)
    assert d.add([], []).shape == (0,) and len(d.free) == 4 and d.empty


class _RecordingNets:
    """``draft_context`` recorded: (taps [.., m*d] first channel, positions, table) per call."""

    def __init__(self, max_batch_size=None):
        self.calls = []
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size

    def draft_context(self, taps, pos, table):
        if getattr(self, "max_batch_size", None) is not None:
            assert taps.shape[0] <= self.max_batch_size, "rows past the network's batch cap"
        self.calls.append((taps[..., 0].clone(), pos.clone(), table.clone()))


def _flat(R, slots):
    """R rows over ``slots`` sequences, interleaved: taps (value = position), positions, table rows."""
    table_rows = np.arange(R) % slots
    positions = 100 * table_rows + np.arange(R) // slots
    return torch.tensor(positions, dtype=torch.float32)[:, None].expand(-1, 3).contiguous(), positions, table_rows


def test_graph_captures_write_nothing_and_replays_write_the_rows():
    """Under graphs (the CPU's eager-replay backend) every capture runs on inert rows (all
    positions -1: no cache write), a later bucket's too, after a write left real rows in the
    buffers; each replay writes exactly its rows, pad rows inert, each with its table row."""
    from dspark_trt.runtime.context_rows import ContextRows
    from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, CapturedGraph
    nets = _RecordingNets()
    w = ContextRows(nets, lambda fn: CapturedGraph(fn, None, EAGER_REPLAY), slots=4, pages=1)
    table = torch.tensor([[7], [8], [9]])
    for R, bucket in ((10, 16), (20, 32), (12, 16)):
        taps, positions, table_rows = _flat(R, 3)
        rows = w.rows(R, taps)
        rows.copy_(taps)
        w.write(rows, positions, table_rows, table)
        *_, (t, pos, tbl) = nets.calls
        assert pos.shape == (bucket, 1)
        np.testing.assert_array_equal(pos[:R, 0].numpy(), positions)
        assert (pos[R:] == -1).all()
        np.testing.assert_array_equal(tbl[:R, 0].numpy(), table[table_rows, 0].numpy())
        torch.testing.assert_close(t[:R, 0], taps[:, 0])
    captures = [pos for _, pos, _ in nets.calls[:1] + nets.calls[2:3]]       # buckets 16 and 32
    assert len(nets.calls) == 5 and all((p == -1).all() for p in captures)
    assert (w.graph_writes, w.eager_writes) == (3, 0)


def test_a_capped_network_takes_padded_rows_in_column_chunks(monkeypatch):
    """Networks with a batch cap (engines) get no graphs and no flat rows past the cap: each
    sequence's rows in its own row of ``[b, L]`` (pads at -1), ``PADDED_COLUMNS`` at a time."""
    from dspark_trt.runtime import context_rows
    monkeypatch.setattr(context_rows, "PADDED_COLUMNS", 3)
    nets = _RecordingNets(max_batch_size=3)
    w = context_rows.ContextRows(nets, lambda fn: pytest.fail("no graphs for a capped network"), slots=3, pages=1)
    taps, positions, table_rows = _flat(8, 3)                 # sequences of 3, 3 and 2 rows
    table = torch.tensor([[7], [8], [9]])
    w.write(w.rows(8, taps).copy_(taps), positions, table_rows, table)
    assert [p.shape for _, p, _ in nets.calls] == [(3, 3)]
    w.write(w.rows(2, taps[:2]).copy_(taps[:2]), positions[:2], table_rows[:2], table)   # within the cap: flat
    assert nets.calls[-1][1].shape == (2, 1)
    taps, positions, table_rows = _flat(11, 2)                # 6 and 5 rows: two chunks of columns
    w.write(w.rows(11, taps).copy_(taps), positions, table_rows, table[:2])
    chunks = nets.calls[-2:]
    assert [p.shape for _, p, _ in chunks] == [(2, 3), (2, 3)]
    pos = torch.cat([p for _, p, _ in chunks], 1)             # [2, 6]: each sequence's rows in order
    np.testing.assert_array_equal(pos.numpy(), [[0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, -1]])
    vals = torch.cat([t for t, _, _ in chunks], 1)
    torch.testing.assert_close(vals[pos >= 0], pos[pos >= 0].float())
    assert all((tbl == table[:2]).all() for _, _, tbl in chunks)


@pytest.mark.parametrize("preset", ["qwen3-tiny-dspark", "deepseek-v4-tiny-dspark"])
def test_flat_rows_write_the_draft_context_of_the_padded_layout(preset):
    """Both draft families write each context row from its taps, position and table row alone:
    the rows of two sequences written flat ([R, 1], each with its sequence's table row, the
    ``ContextRows`` layout) leave the draft cache as ``[b, L]`` writes do (float64)."""
    from dspark_trt.runtime import LLM
    from dspark_trt.runtime.context_rows import ContextRows
    llm = LLM.from_preset(preset, dtype=torch.float64, device="cpu", max_batch_size=2, max_seq_len=64,
                          page_size=16)
    nets, L = llm.networks, 20
    table = torch.tensor([[0, 1], [2, 3]])
    pos = torch.arange(L).repeat(2, 1)                                     # [2, L]
    tokens = torch.randint(3, 200, (2, L), generator=torch.Generator().manual_seed(0))
    _, taps = nets.target(tokens, pos, table)                              # [2, L, m*d]

    def cache_after(write) -> list[torch.Tensor]:
        leaves = [t for t in _leaves(nets.draft_cache)]
        for t in leaves:
            t.zero_()
        write()
        return [t.clone() for t in leaves]
    padded = cache_after(lambda: nets.draft_context(taps, pos, table))
    w = ContextRows(nets)
    flat = cache_after(lambda: w.write(taps.reshape(2 * L, -1), pos.reshape(-1).numpy(),
                                       np.repeat([0, 1], L), table))
    assert any(t.abs().sum() > 0 for t in padded)
    for a, b in zip(padded, flat):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _leaves(cache):
    """The tensors of a draft cache (dicts and lists of tensors)."""
    if isinstance(cache, torch.Tensor):
        yield cache
    elif isinstance(cache, dict):
        for v in cache.values():
            yield from _leaves(v)
    elif isinstance(cache, (list, tuple)):
        for v in cache:
            yield from _leaves(v)
