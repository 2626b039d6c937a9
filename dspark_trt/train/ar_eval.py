"""Speculative decoding with an autoregressive draft, simulated with dense forwards.

The baseline the DSpark/DFlash runtime numbers are compared against: each round a small causal
LM drafts N tokens one by one (greedy, or sampled from ``softmax(z / T)`` with the DRAFT noise
stream), the target scores ``[anchor, x_0 .. x_{N-1}]`` and ``dspark::rejection_sample`` (the
runtime's verifier, same random streams) accepts a prefix and adds one target token.

The round is the runtime's own (``runtime.steps.DecodeSteps.spec_round``: draft step, verify
window, acceptance, context injection, one host read-back); ``ARDraftNetworks`` is the networks
object it drives. Statistics use the runtime's ``SpecStats``. Rows are right-padded in one buffer
and every forward recomputes the whole prefix (no KV cache): simple and exact, meant for
evaluation only.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .. import plugins
from ..plugins.rng import STREAM_DRAFT, gumbel
from ..runtime.sampling_params import SpecStats
from ..runtime.steps import DecodeSteps, RoundInputs
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


class ARDraftNetworks:
    """A target and an autoregressive draft as the networks object of ``DecodeSteps``, over dense
    forwards of one token buffer (row b: prompt b, then its committed tokens; the block table is
    ignored: row b of every round is prompt b).

    ``draft_block`` writes the anchor at its position, then drafts N tokens one forward each;
    ``target`` scores the window of that draft block (the tokens it is given are the anchor and
    those drafts); ``draft_context`` commits the verified rows' tokens (its taps are the tokens).
    Inert rows (start < 0: finished) do the same work at their prompt end, so every forward keeps
    the batch's shape; their results are ignored."""

    has_confidence = False

    def __init__(self, target, draft, prompts: list[list[int]], num_spec_tokens: int,
                 max_new_tokens: int):
        self.target_module, self.draft_module = target, draft
        self.device = dev = target.lm_head.weight.device
        self.num_spec_tokens = N = num_spec_tokens
        self.plen = torch.tensor([len(p) for p in prompts], device=dev)
        self.buf = torch.zeros(len(prompts), int(self.plen.max()) + max_new_tokens + N + 1,
                               dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.buf[b, :len(p)] = torch.tensor(p, device=dev)
        self._arange_b = torch.arange(len(prompts), device=dev)
        self._work = self._lens = None

    def prefill(self, temperature: Tensor, seed: Tensor) -> Tensor:
        """The first token of every row [B] (sampled as the runtime's prefill: position = prompt
        length); it is the first round's anchor."""
        logits, _ = causal_lm_forward(self.target_module, self.buf[:, :int(self.plen.max())])
        return plugins.sample_tokens(logits[self._arange_b, self.plen - 1], temperature, seed,
                                     self.plen)

    def draft_block(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                    seed: Tensor) -> tuple[Tensor, Tensor]:
        live = start >= 0
        self.buf[self._arange_b[live], start[live]] = anchor[live]
        ln = torch.where(live, start + 1, self.plen + 1)   # row length; inert rows: dummy work
        P = ln - 1                                          # anchor position
        work = self.buf.clone()
        drafts, zs = [], []
        for k in range(self.num_spec_tokens):
            cur = ln + k                                    # row length with k drafts
            d_logits, _ = causal_lm_forward(self.draft_module, work[:, :int(cur.max())])
            z = d_logits[self._arange_b, cur - 1].float()  # predicts position P + k + 1
            x = _draft_tokens(z, temperature, seed, P + k + 1)
            work[self._arange_b, cur] = x
            drafts.append(x)
            zs.append(z)
        self._work, self._lens = work, ln
        return torch.stack(drafts, 1), torch.stack(zs, 1)                  # [B, N], [B, N, V]

    def target(self, tokens: Tensor, positions: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor]:
        """The last draft block's window: logits [B, N+1, V] f32 at P .. P+N; taps = tokens."""
        ln, N = self._lens, self.num_spec_tokens
        t_logits, _ = causal_lm_forward(self.target_module, self._work[:, :int((ln + N).max())])
        rows = _rows(t_logits, (ln - 1)[:, None] + torch.arange(N + 1, device=self.device))
        return rows.float(), tokens

    def verify(self, logits: Tensor, drafts: Tensor, draft_logits: Tensor, temperature: Tensor,
               seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        return plugins.rejection_sample(logits, drafts, draft_logits, temperature, seed, start)

    def draft_context(self, taps: Tensor, positions: Tensor, block_table: Tensor) -> None:
        b, j = (positions >= 0).nonzero(as_tuple=True)
        self.buf[b, positions[b, j]] = taps[b, j]


@torch.inference_mode()
def ar_speculative_generate(target, draft, prompts: list[list[int]], num_spec_tokens: int,
                            temperature: float | list[float], max_new_tokens: int,
                            seeds: list[int]) -> list[tuple[list[int], SpecStats]]:
    """-> per prompt (max_new_tokens generated ids, statistics); stop tokens are ignored."""
    if not prompts or len(seeds) != len(prompts):
        raise ValueError(f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
    if num_spec_tokens < 1:
        raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
    B, N = len(prompts), num_spec_tokens
    nets = ARDraftNetworks(target, draft, prompts, N, max_new_tokens)
    steps = DecodeSteps(nets)
    temps = np.array(temperature if isinstance(temperature, list) else [temperature] * B,
                     dtype=np.float32)
    seed = np.array(seeds, dtype=np.int64)
    first = nets.prefill(torch.from_numpy(temps).to(nets.device),
                         torch.from_numpy(seed).to(nets.device)).tolist()
    out = [[t] for t in first]
    anchor = np.array(first, dtype=np.int64)
    position = np.array([len(p) for p in prompts], dtype=np.int64)      # the anchor's position
    stats = [SpecStats(num_spec_tokens=N) for _ in prompts]
    table = np.arange(B, dtype=np.int64)[:, None]
    while True:
        live = np.array([len(o) < max_new_tokens for o in out])
        if not live.any():
            break
        r = RoundInputs(anchor=anchor, start=np.where(live, position, -1), seed=seed,
                        temperature=temps, top_p=np.ones(B, np.float32), table=table)
        host = steps.spec_round(r, mods=False)                           # [B, 2 + N]
        for b in np.flatnonzero(live).tolist():
            a, t, *x = host[b].tolist()
            if a < 0:
                raise FloatingPointError(f"row {b}: the target produced non-finite logits")
            out[b] += x[:a] + [t]
            stats[b].record(a, a + 1)
            anchor[b], position[b] = t, position[b] + a + 1
    return [(o[:max_new_tokens], s) for o, s in zip(out, stats)]
