"""vLLM-style modifiers of the TARGET distribution: penalties, top-k, min-p, top-p.

Speculative decoding stays lossless because the verify step applies the same modifiers to the
target logits at every verify row before acceptance (``steps.DecodeSteps.verify_step``), as the
AR step and the prefill do: rejection sampling is exact for any proposal, so the draft is left
unmodified. Order (vLLM's): penalties on the raw logits, then the top-k and min-p masks (they
commute), then top-p on the distribution they leave; the temperature divides at sampling.

Penalties (vLLM / HF semantics) for the token after row j of a verify window:
  repetition  r: logits of tokens seen in the prompt or the output: l > 0 -> l / r, else l * r
  frequency   f, presence pr:  l -= f * count + pr * (count > 0)   over the OUTPUT tokens
where the output counts are the committed tokens' (anchor included) plus the block's drafts
0 .. j-1. The committed counts live on the device in ``TokenCounts`` (one row per scheduler slot),
so a round needs no host data beyond the slot indices: fixed shapes, no host sync (CUDA graphs).

Each modifier is keyed by a flag of ``Modifiers`` (a separate CUDA graph per combination): rounds
whose requests use none run exactly the steps they ran before the modifiers existed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import plugins


@dataclass(frozen=True)
class Modifiers:
    """Which modifiers a round applies (any row active -> the flag is set for the whole batch;
    neutral rows pass through unchanged)."""

    top_p: bool = False
    top_k: bool = False
    min_p: bool = False
    penalties: bool = False

    @classmethod
    def of(cls, mods: "Modifiers | bool | None") -> "Modifiers":
        """A ``Modifiers``; a bool is the former ``use_top_p`` flag."""
        return mods if isinstance(mods, Modifiers) else cls(top_p=bool(mods))

    @classmethod
    def for_params(cls, params) -> "Modifiers":
        """The flags of a batch of ``SamplingParams``."""
        params = list(params)
        return cls(top_p=any(p.top_p < 1 for p in params),
                   top_k=any(p.top_k > 0 for p in params),
                   min_p=any(p.min_p > 0 for p in params),
                   penalties=any(uses_penalties(p) for p in params))

    @property
    def any(self) -> bool:
        return self.top_p or self.top_k or self.min_p or self.penalties


def uses_penalties(p) -> bool:
    """Whether ``SamplingParams`` p has a presence, frequency or repetition penalty."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class TokenCounts:
    """Per-slot token statistics on the device: ``output`` [S+1, V] int32 counts of the committed
    output tokens, ``prompt`` [S+1, V] bool prompt tokens; row S is scratch (inert rows, slot -1)."""

    def __init__(self, slots: int, vocab: int, device):
        self.slots, self.vocab = slots, vocab
        self.output = torch.zeros(slots + 1, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(slots + 1, vocab, dtype=torch.bool, device=device)

    def index(self, slot: Tensor) -> Tensor:
        """slot [B] (-1: inert) -> row indices [B] (the scratch row for -1)."""
        return torch.where(slot >= 0, slot, self.slots)

    @torch.inference_mode()
    def reset(self, slot: int, prompt_ids: list[int]) -> None:
        """A new request in ``slot`` (eager, at admission): no output yet, its prompt's tokens."""
        self.output[slot].zero_()
        self.prompt[slot].zero_()
        self.prompt[slot, torch.tensor(prompt_ids, device=self.prompt.device)] = True

    def rows(self, slot: Tensor) -> tuple[Tensor, Tensor]:
        """-> (output counts [B, V] int32, prompt mask [B, V] bool) of slot [B]."""
        i = self.index(slot)
        return self.output.index_select(0, i), self.prompt.index_select(0, i)

    def add(self, slot: Tensor, tokens: Tensor, valid: Tensor) -> None:
        """Count the committed tokens [B, W] where valid [B, W] (in place; capturable)."""
        i = self.index(slot)[:, None].expand_as(tokens)
        self.output.index_put_((i, tokens.clamp(min=0)), valid.to(torch.int32), accumulate=True)


def _penalize(logits: Tensor, count: Tensor, prompt: Tensor, presence: Tensor, frequency: Tensor,
              repetition: Tensor) -> Tensor:
    """vLLM's ``apply_penalties`` elementwise (broadcasting; computed in fp32 at least, logits'
    dtype out)."""
    seen = count > 0
    r = torch.where(prompt | seen, repetition, 1.0)
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lf = torch.where(lf > 0, lf / r, lf * r)
    return (lf - frequency * count - presence * seen).to(logits.dtype)


def apply_penalties(logits: Tensor, counts: Tensor, prompt: Tensor, block: Tensor | None,
                    presence: Tensor, frequency: Tensor, repetition: Tensor) -> Tensor:
    """logits [B, W, V]; counts [B, V] (committed output tokens); prompt [B, V] bool; block
    [B, n] (the tokens after the anchor: row j also counts block[:, :j]; None / n = 0: none);
    presence, frequency, repetition [B] -> penalised logits [B, W, V].

    One dense pass with the committed counts, then the n block-token columns of every row
    recomputed with their in-block counts (gather / scatter of [B, W, n]): no [B, W, V] counts."""
    B, W, V = logits.shape
    col = lambda t: t[:, None, None]  # noqa: E731                                  # [B] -> [B, 1, 1]
    pen = (col(presence), col(frequency), col(repetition))
    out = _penalize(logits, counts[:, None], prompt[:, None], *pen)                # [B, W, V]
    if block is None or block.shape[1] == 0 or W < 2:
        return out
    n = block.shape[1]
    tok = block.clamp(min=0)                                                        # [B, n]
    ar_n = torch.arange(n, device=tok.device)
    before = ar_n[None, :] < torch.arange(W, device=tok.device)[:, None]            # [W, n]: k < j
    same = tok[:, :, None] == tok[:, None, :]                                       # [B, n_i, n_k]
    extra = (same[:, None] & before[None, :, None, :]).sum(-1)                      # [B, W, n]
    cnt = counts.gather(1, tok)[:, None, :] + extra                                 # [B, W, n]
    idx = tok[:, None, :].expand(B, W, n)
    fixed = _penalize(logits.gather(2, idx), cnt, prompt.gather(1, tok)[:, None, :], *pen)
    return out.scatter(2, idx, fixed)


def apply_top_k_min_p(logits: Tensor, temperature: Tensor, top_k: Tensor | None,
                      min_p: Tensor | None) -> Tensor:
    """Mask logits [B, ..., V] below each row's k-th largest (top_k [B] int64, <= 0: off; ties at
    the k-th value kept) and below min_p [B] x the top probability of softmax(logits / T)
    (0: off; in log space: l < max + T log min_p). None: that mask is skipped."""
    shape, V = logits.shape, logits.shape[-1]
    flat = logits.reshape(shape[0], -1, V).float()                                  # [B, W, V]
    keep = torch.ones_like(flat, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=V), V) - 1                       # [B] 0-based
        kth = flat.sort(-1, descending=True).values.gather(
            -1, k[:, None, None].expand(-1, flat.shape[1], 1))                      # [B, W, 1]
        keep &= flat >= kth
    if min_p is not None:
        t = torch.where(temperature <= 0, 1.0, temperature.clamp(min=1e-6))
        floor = flat.amax(-1, keepdim=True) + (t * torch.log(min_p))[:, None, None]  # log 0 = -inf
        keep &= flat >= floor
    return logits.masked_fill(~keep.reshape(shape), float("-inf"))


def apply_modifiers(logits: Tensor, x, mods: Modifiers, counts: TokenCounts | None = None,
                    block: Tensor | None = None) -> Tensor:
    """logits [B, W, V] of the rows ``x`` (``steps.DeviceInputs``) -> the modified logits: the
    penalties (``counts`` needed; ``block`` as in ``apply_penalties``), top-k / min-p, top-p."""
    if mods.penalties:
        out, prompt = counts.rows(x.slot)
        logits = apply_penalties(logits, out, prompt, block, x.presence_penalty,
                                 x.frequency_penalty, x.repetition_penalty)
    if mods.top_k or mods.min_p:
        logits = apply_top_k_min_p(logits, x.temperature, x.top_k if mods.top_k else None,
                                   x.min_p if mods.min_p else None)
    if mods.top_p:
        logits = plugins.apply_top_p(logits, x.temperature, x.top_p)
    return logits
