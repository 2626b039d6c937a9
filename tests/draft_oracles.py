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
        tm = inner.target_module
        self.scratch = tm.make_cache(64, 16, inner.dtype, "cpu")

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
    def _next_logits(self, seq: list[int]) -> torch.Tensor:
        tm = self.inner.target_module
        table = torch.arange(-(-len(seq) // 16))[None]        # only the pages in use
        toks = torch.tensor([seq])
        pos = torch.arange(len(seq))[None]
        logits, _ = tm(toks, pos, table, self.scratch)
        return logits[0, -1]

    def draft_block(self, anchor, start, table, temperature, seed):
        B, N = anchor.shape[0], self.num_spec_tokens
        drafts = torch.full((B, N), -1, dtype=torch.int64)
        z_all = torch.zeros(B, N, self.vocab_size, dtype=torch.float32)
        for b in range(B):
            if int(anchor[b]) < 0:
                continue
            h = self.history[int(table[b, 0])]
            seq = [h[p] for p in range(int(start[b]))] + [int(anchor[b])]
            t = float(temperature[b])
            for k in range(N):
                z = self._next_logits(seq).float()
                z = z + self.sigma * torch.randn(z.shape, generator=self.gen)
                if t <= 0:
                    x = int(z.argmax())
                else:
                    x = int(torch.multinomial(torch.softmax(z / t, -1), 1, generator=self.gen))
                drafts[b, k], z_all[b, k] = x, z
                seq.append(x)
        return drafts, z_all
