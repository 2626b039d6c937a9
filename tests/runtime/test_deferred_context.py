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
