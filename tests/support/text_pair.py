"""A tiny text model: random-weight checkpoints of the tiny preset + a byte-level BPE tokenizer."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from dspark_trt.config import get_preset

PRESET = "qwen3-tiny-dspark"


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
             for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.get_vocab_size() == vocab_size
    return tok


def make_tiny_text_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write target + draft HF checkpoints of the tiny preset (random weights, fixed seed) with a
    tokenizer.json whose vocabulary is the model's."""
    from dspark_trt.checkpoints.files import write_checkpoint
    from dspark_trt.checkpoints.qwen3 import qwen3_draft_tensors, qwen3_target_tensors
    from dspark_trt.models import build_models
    pair = get_preset(PRESET)
    target, draft = build_models(pair, torch.float32, "cpu", seed)
    tdir, ddir = root / "target", root / "draft"
    tok = make_tokenizer(pair.target.vocab_size)
    write_checkpoint(tdir, pair.target.to_hf(), qwen3_target_tensors(target),
                     extra_files={"tokenizer.json": tok.to_str()})
    write_checkpoint(ddir, pair.draft.to_hf(), qwen3_draft_tensors(draft))
    return tdir, ddir
