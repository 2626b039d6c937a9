"""Self-distilled draft data: the target continues prompts through the project's runtime.

Prompts are cut from a token stream (the distill split, or the eval split for held-out text);
``Scheduler`` (paged KV cache, continuous batching, no speculation) continues each one by up to
``new_tokens`` tokens, greedily for the first ``greedy_frac`` of the prompts and sampled at
``temperature`` / ``top_p`` for the rest (DeepSpec: T 0.7, top-p 0.8, top-k 20; the runtime's
``SamplingParams`` has no top-k, so top-p only). A continuation ends at the target's eos (kept)
or at ``new_tokens``.

Result (``DistillSet``): tokens [M, L] (prompt, continuation, eos padding) and label_mask [M, L],
True exactly on the generated tokens: the draft loss covers generated tokens only.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..runtime.scheduler import Scheduler
from ..runtime.networks import EagerNetworks
from ..runtime.sampling_params import SamplingParams
from .recipe import DistillSpec
from .tokenizer import EOS_ID


@dataclass
class DistillSet:
    tokens: Tensor          # [M, L] int32
    label_mask: Tensor      # [M, L] bool: generated tokens
    prompt_len: Tensor      # [M] int32
    greedy: Tensor          # [M] bool

    def save(self, path: Path) -> None:
        """Tokens as int16 when the vocabulary allows (half the bytes to carry between runs)."""
        d = dict(self.__dict__)
        if d["tokens"].numel() and int(d["tokens"].max()) < 2**15:
            d["tokens"] = d["tokens"].to(torch.int16)
        torch.save(d, path)

    @classmethod
    def load(cls, path: Path) -> "DistillSet":
        d = torch.load(path, weights_only=True)
        d["tokens"] = d["tokens"].to(torch.int32)
        return cls(**d)

    def stats(self) -> dict:
        gen = self.label_mask.sum(1)
        return {"sequences": int(self.tokens.shape[0]), "length": int(self.tokens.shape[1]),
                "generated_tokens": int(gen.sum()), "greedy": int(self.greedy.sum()),
                "mean_generated": float(gen.float().mean()) if gen.numel() else 0.0}


def cut_prompts(stream: Tensor, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` contiguous slices of ``min_len..max_len`` tokens of stream [S] (seeded)."""
    if stream.numel() <= max_len:
        raise ValueError(f"token stream of {stream.numel()} tokens is too short for prompts of "
                         f"{max_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        start = rng.randint(0, stream.numel() - length)
        out.append(stream[start:start + length].tolist())
    return out


def _scheduler(target, batch: int, max_seq_len: int, device, dtype, graphs: bool) -> Scheduler:
    """A target-only Scheduler; ``graphs``: replay its decode step from CUDA graphs."""
    page = 64 if max_seq_len >= 256 else 16
    pages_per_seq = -(-(max_seq_len + 1) // page)
    nets = EagerNetworks(target, None, batch * pages_per_seq, page, device, dtype)
    steps = None
    if graphs:
        from ..runtime.cuda_graphs import GraphedSteps
        from ..runtime.steps import DecodeSteps
        steps = GraphedSteps(DecodeSteps(nets), batch, pages_per_seq)
    return Scheduler(nets, batch, max_seq_len, target.config.vocab_size, [EOS_ID],
                     speculative=False, steps=steps)


def continue_prompts(target, prompts: list[list[int]], spec: DistillSpec, seed: int, device,
                     dtype=torch.float32, log: Callable[[str], None] = print) -> DistillSet:
    """Generate the continuations (batches of ``spec.batch_size``) -> DistillSet."""
    n_greedy = round(spec.greedy_frac * len(prompts))
    L = max(len(p) for p in prompts) + spec.new_tokens
    B = min(spec.batch_size, len(prompts))
    reqs = []
    for i, p in enumerate(prompts):
        greedy = i < n_greedy
        reqs.append((p, SamplingParams(temperature=0.0 if greedy else spec.temperature,
                                       top_p=1.0 if greedy else spec.top_p,
                                       max_new_tokens=spec.new_tokens, seed=seed * 1_000_003 + i)))
    graphs = torch.device(device).type == "cuda"
    try:                                       # continuous batching over all prompts
        outs = _scheduler(target, B, L + 1, device, dtype, graphs).run(reqs)
    except RuntimeError as e:
        if not graphs:
            raise
        log(f"[train] distill: CUDA graphs failed ({e}); generating eagerly")
        outs = _scheduler(target, B, L + 1, device, dtype, False).run(reqs)
    tokens = torch.full((len(prompts), L), EOS_ID, dtype=torch.int32)
    mask = torch.zeros(len(prompts), L, dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if o.finish_reason == "error":
            raise RuntimeError(f"distillation prompt {i}: {o.error}")
        seq = p + o.output_ids
        tokens[i, :len(seq)] = torch.tensor(seq, dtype=torch.int32)
        mask[i, len(p):len(seq)] = True
    out = DistillSet(tokens, mask, torch.tensor([len(p) for p in prompts], dtype=torch.int32),
                     torch.arange(len(prompts)) < n_greedy)
    log(f"[train] distill: {out.stats()}")
    return out


class DistillSampler:
    """Random batches of rows of a DistillSet (with replacement, seeded): the same sequence of
    batches for every draft trained with the same seed."""

    def __init__(self, data: DistillSet, batch_size: int, seed: int, device):
        self.data, self.batch_size, self.device = data, batch_size, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        """-> tokens [B, L] int64, label_mask [B, L] bool."""
        idx = torch.randint(0, self.data.tokens.shape[0], (self.batch_size,), generator=self.gen)
        return (self.data.tokens[idx].long().to(self.device),
                self.data.label_mask[idx].to(self.device))
