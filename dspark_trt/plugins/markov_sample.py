"""dspark::markov_sample — DSpark's sequential Markov sampler (algorithm doc §3.2).

For each row, N dependent steps: ``z_k = U_k + W2 · W1[prev]`` (bias before temperature),
``x_k = argmax(z_k)`` at temperature 0, else the Gumbel-max sample of ``softmax(z_k / T)`` with
noise keyed by (seed, position P + k + 1, STREAM_DRAFT); ``prev = x_k``. The corrected logits
``z_k`` are returned: ``softmax(z_k / T)`` is exactly the proposal the verifier must use.
Rows with ``anchor < 0`` are inert: tokens -1, logits 0. Rank 0 is a DFlash-style draft.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rng import STREAM_DRAFT, gumbel


def markov_sample_ref(base_logits: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor,
                      temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    """base_logits U [B, N, V]; anchor, seed, start (= P) [B]; w1, w2 [V, r]; temperature [B].

    Returns tokens [B, N] int64 and corrected logits z [B, N, V] float32.
    """
    B, N, V = base_logits.shape
    acc = torch.promote_types(base_logits.dtype, torch.float32)
    live = anchor >= 0
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-6)).to(acc)
    prev = anchor.clamp(min=0)
    tokens, logits = [], []
    for k in range(N):
        bias = w1[prev].to(acc) @ w2.to(acc).T                                      # [B, V]
        z = base_logits[:, k].to(acc) + bias
        noise = gumbel(seed, start + k + 1, STREAM_DRAFT, V).to(acc)
        sampled = torch.argmax(z * inv_t[:, None] + noise, dim=-1)
        x = torch.where(greedy, torch.argmax(z, dim=-1), sampled)
        tokens.append(torch.where(live, x, -1))
        logits.append(torch.where(live[:, None], z, 0.0))
        prev = x
    return torch.stack(tokens, 1), torch.stack(logits, 1).to(torch.float32)


@torch.library.custom_op("dspark::markov_sample", mutates_args=())
def markov_sample(base_logits: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor,
                  temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    return markov_sample_ref(base_logits, anchor, w1, w2, temperature, seed, start)


@markov_sample.register_fake
def _(base_logits, anchor, w1, w2, temperature, seed, start):
    B, N, V = base_logits.shape
    return (base_logits.new_empty((B, N), dtype=torch.int64),
            base_logits.new_empty((B, N, V), dtype=torch.float32))
