"""Graph capture runs with the garbage collector off (CPU: the guard itself)."""
from __future__ import annotations

import gc

import pytest

from dspark_trt.runtime.cuda_graphs import _no_gc


@pytest.mark.parametrize("was_enabled", [True, False])
def test_no_garbage_collection_during_capture(was_enabled):
    """A collection mid-capture may destroy another graph (an abort on the H200): captures run
    with the collector off, and its previous state comes back, after an error too."""
    (gc.enable if was_enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError):
            with _no_gc():
                assert not gc.isenabled()
                raise RuntimeError("capture failed")
        assert gc.isenabled() == was_enabled
    finally:
        gc.enable()
