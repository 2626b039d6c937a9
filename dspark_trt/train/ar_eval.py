"""Speculative decoding with an autoregressive draft, simulated with dense forwards.

The baseline the DSpark/DFlash runtime numbers are compared against: each round a small causal
LM drafts N tokens one by one (greedy, or sampled from ``softmax(z / T)`` with the DRAFT noise
stream), the target scores ``[anchor, x_0 .. x_{N-1}]`` and ``dspark::rejection_sample`` (the
runtime's verifier, same random streams) accepts a prefix and adds one target token. Statistics
use the runtime's ``SpecStats``. Rows are right-padded in one buffer and every forward recomputes
the whole prefix (no KV cache): simple and exact, meant for evaluation only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import plugins
from ..plugins.rng import STREAM_DRAFT, gumbel
from ..runtime.sampling_params import SpecStats
from .dense import causal_lm_forward


def _rows(logits: Tensor, index: Tensor) -> Tensor:
    """logits [B, T, V], index [B, K] -> [B, K, V]."""
    return logits.gather(1, index[..., None].expand(*index.shape, logits.shape[-1]))


def _draft_tokens(z: Tensor, temperature: Tensor, seed: Tensor, position: Tensor) -> Tensor:
    """argmax at T = 0, else a Gumbel-max sample of softmax(z / T) keyed by (seed, position)."""
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-6))
    noise = gumbel(seed, position, STREAM_DRAFT, z.shape[-1])
    sampled = (z.float() * inv_t[:, None] + noise).argmax(-1)
    return torch.where(greedy, z.argmax(-1), sampled)


@torch.no_grad()
def ar_speculative_generate(target, draft, prompts: list[list[int]], num_spec_tokens: int,
                            temperature: float | list[float], max_new_tokens: int,
                            seeds: list[int]) -> list[tuple[list[int], SpecStats]]:
    """-> per prompt (max_new_tokens generated ids, statistics); stop tokens are ignored."""
    if not prompts or len(seeds) != len(prompts):
        raise ValueError(f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
    if num_spec_tokens < 1:
        raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
    dev = target.lm_head.weight.device
    B, N = len(prompts), num_spec_tokens
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    buf = torch.zeros(B, int(plen.max()) + max_new_tokens + N + 1, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        buf[b, :len(p)] = torch.tensor(p, device=dev)
    temps = torch.tensor(temperature if isinstance(temperature, list) else [temperature] * B,
                         dtype=torch.float32, device=dev)
    seed = torch.tensor(seeds, dtype=torch.long, device=dev)
    arange_b = torch.arange(B, device=dev)
    stats = [SpecStats(num_spec_tokens=N) for _ in prompts]

    # first token from the prompt (as the runtime's prefill: position = prompt length)
    logits, _ = causal_lm_forward(target, buf[:, :int(plen.max())])
    first = plugins.sample_tokens(logits[arange_b, plen - 1], temps, seed, plen)
    buf[arange_b, plen] = first
    lens = plen + 1                                              # committed tokens per row
    while True:
        live = (lens - plen) < max_new_tokens
        if not bool(live.any()):
            break
        ln = torch.where(live, lens, plen + 1)                  # finished rows: inert dummy work
        P = ln - 1                                               # anchor position
        work = buf.clone()
        drafts, zs = [], []
        for k in range(N):
            cur = ln + k                                         # row length with k drafts
            d_logits, _ = causal_lm_forward(draft, work[:, :int(cur.max())])
            z = d_logits[arange_b, cur - 1].float()              # predicts position P + k + 1
            x = _draft_tokens(z, temps, seed, P + k + 1)
            work[arange_b, cur] = x
            drafts.append(x)
            zs.append(z)
        drafts_t, z_t = torch.stack(drafts, 1), torch.stack(zs, 1)          # [B, N], [B, N, V]
        t_logits, _ = causal_lm_forward(target, work[:, :int((ln + N).max())])
        rows = _rows(t_logits, P[:, None] + torch.arange(N + 1, device=dev))  # [B, N+1, V]
        start = torch.where(live, P, -1)
        accepted, nxt = plugins.rejection_sample(rows.float(), drafts_t, z_t, temps, seed, start)
        for b in torch.nonzero(live).flatten().tolist():
            a = int(accepted[b])
            new = drafts_t[b, :a].tolist() + [int(nxt[b])]
            L = int(lens[b])
            buf[b, L:L + len(new)] = torch.tensor(new, device=dev)
            lens[b] = L + len(new)
            stats[b].record(a, a + 1)
    return [(buf[b, int(plen[b]):int(plen[b]) + max_new_tokens].tolist(), stats[b])
            for b in range(B)]
