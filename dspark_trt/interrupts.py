"""SIGINT / SIGTERM as exceptions, so that ``finally`` / ``except BaseException`` clean-ups run.

``signals_raise_interrupted()`` (the CLI's long commands) turns both signals into
``Interrupted``, a ``KeyboardInterrupt`` that remembers its signal: the command ends with a
one-line message and exit code 128 + signal (130 for SIGINT, 143 for SIGTERM).
``deferred_interrupts()`` holds both signals back over a short critical section (e.g. renaming a
finished engine into place) and delivers them when it ends.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGINT or SIGTERM arrives (``signum`` says which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def signals_raise_interrupted() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM raise ``Interrupted`` (main thread only; elsewhere a
    no-op); the previous handlers are restored after it."""
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        _restore(previous)


def _restore(previous: dict) -> None:
    for s, h in previous.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)   # None: set outside Python


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """SIGINT / SIGTERM arriving inside the block are delivered (to the previous handlers) when
    it ends, so the block runs to its end. Main thread only; elsewhere a no-op."""
    if not _in_main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in SIGNALS}
    try:
        yield
    finally:
        _restore(previous)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)
