"""Shared fixtures: tiny random model pairs in float64 (no near-ties between decode paths)."""
from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from tests.support.models import tiny_pair

# Tiny models: one thread is faster than two (and far faster on a loaded machine).
torch.set_num_threads(1)


@pytest.fixture
def make_pair():
    return tiny_pair


# CPython (3.11+) keeps Python frames on a per-thread data stack of 16 KiB chunks and unmaps a
# chunk as soon as the frame that opened it returns, so a hot call path that straddles a chunk
# boundary pays an mmap + munmap (and page faults) per call. Under pytest's deeper stack this hit
# torch.export / inductor hard: the V4 engine test spent 8.5 min in the kernel for 6.5 min of
# user time. The test loop runs above one frame that declares 2 MiB of (never touched) stack: it
# gets a 4 MiB chunk, and every frame of the tests stays inside that chunk.
def _with_roomy_stack(fn):
    return fn()


_with_roomy_stack.__code__ = _with_roomy_stack.__code__.replace(co_stacksize=1 << 18)   # slots


class _RoomyStack:
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        """The test loop of the other plugins (pytest's own), run above the roomy frame."""
        rest = session.config.pluginmanager.subset_hook_caller("pytest_runtestloop", [self])
        return _with_roomy_stack(lambda: rest(session=session))


def pytest_configure(config):
    config.pluginmanager.register(_RoomyStack(), "dspark-roomy-stack")
    # the project's own caches (the AOTI compiler check) go to a directory of this test session
    os.environ.setdefault("DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark-test-cache-"))
    if os.environ.get("CI") == "true" and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError("CI=true but Triton is not installed: every kernel test would be skipped "
                                "(install the test extra: pip install -e \".[test]\")")


@pytest.hookimpl(trylast=True)                  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items):
    """Start the background jobs (tests/support/prebuilt.py) of the selected tests and run the
    modules that use them last. Not for --collect-only, nor in an xdist worker (which runs only
    some of the items: its jobs start when a test first waits for them)."""
    if config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.support import prebuilt
    items[:] = prebuilt.start_for(items)


def pytest_unconfigure(config):
    from tests.support import prebuilt
    prebuilt.shutdown()
