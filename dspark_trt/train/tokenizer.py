"""Byte-level BPE tokenizer trained with the ``tokenizers`` library, with two special tokens.

Id 0 is ``<|endoftext|>`` (separates documents; the target's eos) and id 1 is ``<|mask|>`` (the
draft's mask token, never seen by the target). Byte-level pre-tokenization makes
``decode(encode(text)) == text`` for any text.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
EOS_ID, MASK_ID = 0, 1


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train on ``texts`` (in order); at most ``vocab_size`` entries (fewer if the text runs out
    of merges)."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is below 256 bytes + special tokens + merges")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS_ID or tok.token_to_id(MASK_TOKEN) != MASK_ID:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    return tok


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()
