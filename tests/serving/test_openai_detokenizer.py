"""Incremental detokenizer and stop-string matcher against whole-text references."""
from __future__ import annotations

import random

import pytest

from dspark_trt.commands.common import default_pair_dirs
from dspark_trt.runtime.llm import load_tokenizer
from dspark_trt.openai_server.detokenizer import DecodeStream, IncrementalDetokenizer
from dspark_trt.openai_server.stop_strings import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_pair_dirs()[0])


MODES = [pytest.param(True, id="decode_stream"), pytest.param(False, id="prefix_offset")]


@pytest.mark.parametrize("use_decode_stream", MODES)
def test_incremental_text_equals_full_decode(tokenizer, use_decode_stream):
    if use_decode_stream and DecodeStream is None:
        pytest.skip("this tokenizers has no DecodeStream")
    texts = ["Once upon a time, the cat sat on the mat.\n\n    def f(x):\n        return x",
             "héllo wörld — naïve café 日本語 テキスト 🎉🚀 done"]        # multi-byte characters
    rng = random.Random(0)
    id_lists = [tokenizer.encode(t).ids for t in texts]
    id_lists.append([rng.randrange(2, tokenizer.get_vocab_size()) for _ in range(300)])
    id_lists.append([5, 0, 7, 1, 9])                           # special tokens inside: skipped
    for ids in id_lists:
        detok = IncrementalDetokenizer(tokenizer, use_decode_stream=use_decode_stream)
        pieces = [detok.add([t]) for t in ids]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert sum(bool(p) for p in pieces) > len(ids) // 3     # text does come out token by token


def test_multi_token_add_equals_single_steps(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog 🎉").ids
    one, many = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
    single = "".join(one.add([t]) for t in ids)
    chunked = "".join(many.add(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert single == chunked == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_split_across_deltas_is_cut():
    m = StopStringMatcher(["STOP", "\n\n"])
    out = [m.feed(d) for d in ["abc S", "T", "OP tail", "more"]]
    assert "".join(out) == "abc " and m.matched == "STOP"
    assert out[0] == "abc " and out[1] == ""                   # "S", "ST" held back, then dropped


def test_stop_string_held_text_is_released_when_it_is_not_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("xx ST") == "xx " and m.feed("ART") == "START" and m.matched is None
    assert m.feed("ends S") == "ends " and m.flush() == "S"


def test_earliest_stop_string_wins():
    m = StopStringMatcher(["b", "a"])
    assert m.feed("xxab") == "xx" and m.matched == "a"


def test_without_a_tokenizer_the_text_stays_empty():
    from dspark_trt.openai_server.detokenizer import IncrementalDetokenizer as D
    d = D(None)
    assert d.add([1, 2, 3]) == "" and d.add([4]) == ""
