"""Log-probabilities of the emitted tokens under the target's distribution (``SamplingParams.logprobs``).

Which distribution: the RAW target model's, ``log_softmax`` of the target logits in float32 at the
position that emitted the token, before the penalties, top-k, min-p, top-p and temperature (vLLM's
default ``logprobs_mode="raw_logprobs"``). So the numbers do not depend on the sampling settings,
and a greedy speculative run reports what autoregressive decoding, or one forward of the target
over the whole sequence, gives for the same tokens (up to float rounding of the batched windows).

Rounds that need them run their steps eagerly (``DecodeSteps``; the CUDA graphs have no logprob
outputs): the verify step's window gives one row per committed token (the accepted drafts, then
the bonus / correction token), the AR step and the prefill one each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .sampling_params import MAX_LOGPROBS  # noqa: F401  (most top logprobs a request may ask for)


@dataclass
class TokenLogprob:
    """One emitted token: its log-probability and the ``k`` most likely tokens (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class LogprobRows:
    """Host copies of a step's logprobs for B rows and W window positions."""

    chosen: np.ndarray        # [B, W] float32: logprob of the token emitted at each position
    top_ids: np.ndarray       # [B, W, k] int64
    top_vals: np.ndarray      # [B, W, k] float32

    def entries(self, row: int, tokens: list[int], k: int) -> list[TokenLogprob]:
        """The first len(tokens) positions of ``row`` with its top ``k`` (<= the step's k)."""
        return [TokenLogprob(t, float(self.chosen[row, j]),
                             [(int(i), float(v)) for i, v in zip(self.top_ids[row, j, :k],
                                                                 self.top_vals[row, j, :k])])
                for j, t in enumerate(tokens)]


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, W, V] (raw), tokens [B, W] (negative: none, logprob 0) -> chosen [B, W] f32,
    top ids [B, W, k] i64, top values [B, W, k] f32 (sorted, most likely first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    chosen = torch.where(tokens >= 0, chosen, 0.0)
    vals, ids = lp.topk(k, dim=-1) if k > 0 else (lp[..., :0], tokens[..., None][..., :0])
    return chosen, ids, vals


def to_host(chosen: Tensor, ids: Tensor, vals: Tensor) -> LogprobRows:
    return LogprobRows(chosen.cpu().numpy(), ids.cpu().numpy(), vals.cpu().numpy())


def emitted_tokens(drafts: Tensor, nxt: Tensor, accepted: Tensor) -> Tensor:
    """The token each verify row emits [B, N+1]: draft j for j < accepted, then the next token
    (the positions after it are not committed; they get the next token too, unused)."""
    N = drafts.shape[1]
    offs = torch.arange(N + 1, device=drafts.device)
    full = torch.cat([drafts, nxt[:, None]], 1)
    return torch.where(offs[None, :] < accepted[:, None], full, nxt[:, None])
