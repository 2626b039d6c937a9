"""Data pipeline and objective pieces: split rule, determinism, tokenizer, labels, weights."""
import math

import pytest
import torch

from dspark_trt.train.batches import WindowSampler, eval_prompts, token_stream
from dspark_trt.train.corpus import is_heldout, module_name, read_stdlib
from dspark_trt.train.objective import (block_labels, lr_at, markov_prev, position_weights,
                                        sample_anchors)
from dspark_trt.train.tokenizer import EOS_ID, MASK_ID, train_tokenizer
from pathlib import Path


def test_split_rule_is_by_module_name():
    assert is_heldout("json") and is_heldout("json.decoder")
    assert is_heldout("test.test_json.test_fail") and is_heldout("test.test_textwrap")
    assert not is_heldout("email.parser") and not is_heldout("test.test_email.test_parser")
    assert not is_heldout("jsonx") and not is_heldout("test.test_jsonx")
    assert module_name(Path("json/__init__.py")) == "json"
    assert module_name(Path("test/test_json/test_fail.py")) == "test.test_json.test_fail"


@pytest.fixture(scope="module")
def mini_stdlib(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    files = {"json/__init__.py": "import sys\n\ndef dumps(x):\n    return repr(x)\n",
             "json/decoder.py": "class JSONDecodeError(ValueError):\n    pass\n" * 5,
             "alpha.py": "def alpha(a, b):\n    return a + b\n" * 20,
             "pkg/beta.py": "for i in range(10):\n    print(i)\n" * 20,
             "site-packages/ignored.py": "x = 1\n",
             "latin1.py": b"s = '\xe9'\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def test_read_stdlib_is_deterministic_and_skips_non_utf8(mini_stdlib):
    train, held, man = read_stdlib(mini_stdlib)
    assert [f.module for f in train] == ["alpha", "pkg.beta"]
    assert [f.module for f in held] == ["json", "json.decoder"]
    assert man.skipped_not_utf8 == ["latin1"]
    assert read_stdlib(mini_stdlib)[2].files_sha256 == man.files_sha256
    (mini_stdlib / "alpha.py").write_text("changed = True\n")
    try:
        changed = read_stdlib(mini_stdlib)[2]
        assert changed.files_sha256 != man.files_sha256
        assert changed.heldout_sha256 == man.heldout_sha256      # held-out files did not change
    finally:
        (mini_stdlib / "alpha.py").write_text("def alpha(a, b):\n    return a + b\n" * 20)


def test_tokenizer_roundtrip_special_ids_and_determinism(mini_stdlib):
    train, held, _ = read_stdlib(mini_stdlib)
    tok = train_tokenizer([f.text for f in train], 320)
    assert 258 < tok.get_vocab_size() <= 320
    assert tok.token_to_id("<|endoftext|>") == EOS_ID and tok.token_to_id("<|mask|>") == MASK_ID
    text = held[1].text + "ünïcødé\t\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert train_tokenizer([f.text for f in train], 320).to_str() == tok.to_str()


def test_windows_and_prompts_are_reproducible():
    stream = token_stream([list(range(5, 200)), list(range(7, 150))])
    assert stream[195].item() == EOS_ID and stream.numel() == 195 + 143 + 2
    a = WindowSampler(stream, 16, 4, seed=3, device="cpu")
    b = WindowSampler(stream, 16, 4, seed=3, device="cpu")
    wa = a.next()
    assert wa.shape == (4, 16) and torch.equal(wa, b.next())
    assert torch.equal(wa[:, 1:] - wa[:, :-1] == 1, (wa[:, 1:] != EOS_ID) & (wa[:, :-1] != EOS_ID))
    files = [list(range(100 + 3 * i)) for i in range(4)]
    p1, p2 = eval_prompts(files, 9, 20, 40, seed=1), eval_prompts(files, 9, 20, 40, seed=1)
    assert p1 == p2 and len(p1) == 9 and all(20 <= len(p) <= 40 for p in p1)
    assert all(p == list(range(p[0], p[0] + len(p))) for p in p1)     # contiguous slices


def test_block_labels_prev_and_weights():
    tokens = torch.arange(100, 110)[None]                   # x_t = 100 + t, T = 10
    anchors = torch.tensor([[2, 7]])
    labels, valid = block_labels(tokens, anchors, 4)
    assert labels.tolist() == [[[103, 104, 105, 106], [108, 109, 0, 0]]]
    assert valid.tolist() == [[[True] * 4, [True, True, False, False]]]
    assert markov_prev(tokens, anchors, labels).tolist() == [[[102, 103, 104, 105],
                                                              [107, 108, 109, 0]]]
    w = position_weights(valid, 4.0)
    assert w[0, 0].tolist() == pytest.approx([math.exp(-k / 4) for k in range(4)])
    assert w[0, 1].tolist() == pytest.approx([1.0, math.exp(-0.25), 0.0, 0.0])


def test_anchor_sampling_and_schedule():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 20, 19, g, "cpu")
    assert all(row == list(range(19)) for row in a.tolist())     # all anchors 0..T-2, each once
    b = sample_anchors(5, 50, 7, g, "cpu")
    assert all(len(set(r)) == 7 and max(r) <= 48 and r == sorted(r) for r in b.tolist())
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(1, 8, 8, g, "cpu")
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)
