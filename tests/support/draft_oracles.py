"""Test drafts with controllable acceptance: proposals from the target itself, perturbed.

``NearTargetNetworks`` wraps ``EagerNetworks`` and replaces the DSpark draft by a proposal built from
the target's own next-token logits (full recompute over the committed history) plus Gaussian noise,
sampled sequentially like the Markov sampler: z_k = target_logits_k + sigma * eps, x_k ~ softmax(z_k/T)
(argmax at T = 0). It returns z as the proposal logits, so verification stays exact. Small sigma gives
long accepted runs with occasional rejections: the loop's bookkeeping is exercised at every offset.
"""
from __future__ import annotations

import torch

from dspark_trt.runtime.networks import EagerNetworks


class NearTargetNetworks:
    def __init__(self, inner: EagerNetworks, sigma: float = 1.0, seed: int = 0):
        self.inner, self.sigma = inner, sigma
        self.gen = torch.Generator().manual_seed(seed)
        for name in ("num_spec_tokens", "num_pages", "page_size", "device", "dtype", "vocab_size"):
            setattr(self, name, getattr(inner, name))
        self.history: dict[int, dict[int, int]] = {}

    def _record(self, tokens, positions, table):
        for b in range(tokens.shape[0]):
            h = self.history.setdefault(int(table[b, 0]), {})
            for t, p in zip(tokens[b].tolist(), positions[b].tolist()):
                if p >= 0:
                    h[p] = t

    def target(self, tokens, positions, table):
        self._record(tokens, positions, table)
        return self.inner.target(tokens, positions, table)

    def draft_context(self, taps, positions, table):
        self.inner.draft_context(taps, positions, table)

    def verify(self, *args):
        return self.inner.verify(*args)

    @torch.inference_mode()
    def _next_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Target logits after each sequence [len(seqs), V]: one padded batch (pad positions -1
        are inert), every row on pages of its own in a scratch cache."""
        tm = self.inner.target_module
        B, L = len(seqs), max(map(len, seqs))
        P = -(-L // 16)
        toks = torch.tensor([s + [0] * (L - len(s)) for s in seqs])
        pos = torch.tensor([list(range(len(s))) + [-1] * (L - len(s)) for s in seqs])
        cache = tm.make_cache(B * P, 16, self.dtype, "cpu")
        logits, _ = tm(toks, pos, torch.arange(B * P).view(B, P), cache)
        return logits[torch.arange(B), torch.tensor([len(s) - 1 for s in seqs])]

    def draft_block(self, anchor, start, table, temperature, seed):
        B, N = anchor.shape[0], self.num_spec_tokens
        drafts = torch.full((B, N), -1, dtype=torch.int64)
        z_all = torch.zeros(B, N, self.vocab_size, dtype=torch.float32)
        live = torch.nonzero(anchor >= 0)[:, 0]
        if len(live) == 0:
            return drafts, z_all
        seqs = []
        for b in live.tolist():
            h = self.history[int(table[b, 0])]
            seqs.append([h[p] for p in range(int(start[b]))] + [int(anchor[b])])
        t = temperature[live].float()
        greedy, t = t <= 0, torch.where(t > 0, t, 1.0)[:, None]
        for k in range(N):                      # all live rows at once, position by position
            z = self._next_logits(seqs).float()
            z = z + self.sigma * torch.randn(z.shape, generator=self.gen)
            sampled = torch.multinomial(torch.softmax(z / t, -1), 1, generator=self.gen)[:, 0]
            x = torch.where(greedy, z.argmax(-1), sampled)
            drafts[live, k], z_all[live, k] = x, z
            for s, xi in zip(seqs, x.tolist()):
                s.append(xi)
        return drafts, z_all
