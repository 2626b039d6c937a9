"""Incremental detokenization for streaming, with stop strings.

Streamed text deltas concatenate to exactly the final text: a delta is only released when the new
decoded text extends what was already sent, text ending in an incomplete UTF-8 sequence (U+FFFD)
is held back, and so is a tail that could still become a stop string.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Accumulates token ids of one request; ``push`` returns the text delta that is safe to send."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] = ()):
        self.decode = decode
        self.stop = list(stop)
        self.ids: list[int] = []
        self.sent = ""                   # text already released
        self.stopped = False             # a stop string was found; later ids are ignored

    def push(self, ids: list[int]) -> tuple[str, int]:
        """Add ids -> (delta, number of the given ids kept). Fewer are kept once a stop string ends."""
        if self.stopped or not ids:
            return "", 0
        kept = len(ids)
        text = self.decode(self.ids + ids)
        if self.stop and self._find_stop(text) is not None:
            for kept in range(1, len(ids) + 1):             # the first id that completes a stop
                text = self.decode(self.ids + ids[:kept])
                if self._find_stop(text) is not None:
                    break
            self.stopped = True
        self.ids += ids[:kept]
        return self._release(self.text() if self.stopped else self._safe(text)), kept

    def finish(self) -> str:
        """The rest of the text (call once, when the request ends)."""
        return self._release(self.text())

    def text(self) -> str:
        """Full text so far, cut before the first stop string."""
        text = self.decode(self.ids)
        cut = self._find_stop(text)
        return text if cut is None else text[:cut]

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe(self, text: str) -> str:
        text = text.rstrip(REPLACEMENT)
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[:len(text) - hold]

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent):   # decoding changed earlier text: wait for it to settle
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
