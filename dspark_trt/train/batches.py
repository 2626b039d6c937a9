"""Token streams, random training windows and the fixed evaluation prompts.

Everything here is deterministic given the files, the tokenizer and the seed: batches come from a
seeded ``torch.Generator`` on the CPU, prompts from a seeded ``random.Random``.
"""
from __future__ import annotations

import random

import torch
from torch import Tensor

from .tokenizer import EOS_ID


def encode_files(tok, texts: list[str]) -> list[list[int]]:
    """Token ids per file, in file order."""
    return [e.ids for e in tok.encode_batch(texts)]


def token_stream(files_ids: list[list[int]]) -> Tensor:
    """Concatenate files, each followed by ``<|endoftext|>`` -> [n] int32."""
    out = []
    for ids in files_ids:
        out.extend(ids)
        out.append(EOS_ID)
    return torch.tensor(out, dtype=torch.int32)


class WindowSampler:
    """Random windows of ``length`` tokens from a stream (with replacement), reproducible by seed."""

    def __init__(self, stream: Tensor, length: int, batch_size: int, seed: int, device):
        if stream.numel() < length + 1:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than one window "
                             f"of {length + 1}")
        self.stream = stream.to(device)
        self.length, self.batch_size = length, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(length, device=device)

    def next(self) -> Tensor:
        """-> [batch_size, length] int64."""
        hi = self.stream.numel() - self.length
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen)
        return self.stream[starts.to(self.stream.device)[:, None] + self.offsets].long()


def fixed_windows(stream: Tensor, length: int, count: int) -> Tensor:
    """``count`` evenly spaced windows [count, length] (a fixed held-out batch)."""
    count = max(1, min(count, stream.numel() // length))
    step = (stream.numel() - length) // count
    return torch.stack([stream[i * step: i * step + length] for i in range(count)]).long()


def eval_prompts(files_ids: list[list[int]], n: int, min_len: int, max_len: int,
                 seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``min_len..max_len`` tokens cut from held-out files (round-robin over the
    files long enough), positions and lengths from ``random.Random(seed)``."""
    if not 0 < min_len <= max_len:
        raise ValueError(f"prompt lengths must satisfy 0 < min_len <= max_len, got {min_len}, {max_len}")
    long_files = [ids for ids in files_ids if len(ids) >= max_len]
    if not long_files:
        raise ValueError(f"no held-out file has {max_len} tokens for a prompt")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        ids = long_files[i % len(long_files)]
        length = rng.randint(min_len, max_len)
        start = rng.randint(0, len(ids) - length)
        prompts.append(list(ids[start:start + length]))
    return prompts
