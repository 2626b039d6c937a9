"""Stop strings matched on the decoded text, across token boundaries.

Text that could still be the start of a stop string is held back until the next delta decides
it; a match ends the request and the stop string (and anything after it) is cut.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Text of ``delta`` that is safe to emit now; sets ``matched`` when a stop string appears."""
        if self.matched is not None:
            return ""
        text = self._held + delta
        if not self.stop_strings:
            self._held = ""
            return text
        hits = [(text.find(s), s) for s in self.stop_strings if s in text]
        if hits:
            cut, self.matched = min(hits)
            self._held = ""
            return text[:cut]
        hold = self._longest_partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
