"""Incremental detokenization: text deltas from token ids without re-decoding the sequence.

``tokenizers.decoders.DecodeStream`` keeps only a small window of recent ids (it returns None
while the bytes so far do not form complete characters), so each token costs O(1) decoding.
Where the installed ``tokenizers`` lacks it, a prefix-offset method like vLLM's is used: decode
the last few tokens with and without the new one and emit the difference once it is not a
partial UTF-8 character.
"""
from __future__ import annotations

try:                                                    # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:                                     # pragma: no cover - older tokenizers
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids in order with ``add``; each call returns the new text (possibly ""). Without
    a tokenizer (a model served for token-id prompts) the text stays empty: clients read
    ``return_token_ids``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, use_decode_stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if use_decode_stream and DecodeStream is not None and tokenizer is not None
                        else None)
        self._ids: list[int] = []          # fallback only: ids since prefix_offset
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Text that ``token_ids`` (the next ids of the sequence) complete."""
        if self.tokenizer is None:
            return ""
        return "".join(self._add_one(int(t)) for t in token_ids)

    def _add_one(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self.tokenizer, token_id) or ""
        return self._add_prefix_offset(token_id)

    def _add_prefix_offset(self, token_id: int) -> str:
        """vLLM's method: text(prefix..end) minus text(prefix..read), once it is whole."""
        self._ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            # keep a short window: later tokens only need the last few ids as context
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            if self._prefix_offset > 0:
                self._ids = self._ids[self._prefix_offset:]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return delta
        return ""
