"""Training objectives (algorithm doc §10).

Draft blocks: anchors sampled per sequence; row k of the block anchored at ``a`` is labelled
``x*_{a+1+k}`` and weighted ``w_k = exp(-k / decay) * cumprod(valid)``;
``L = ce_weight * CE(z_k, x*) + l1_weight * ‖softmax(z_k) − softmax(U^t_{a+k})‖₁`` (weighted means),
where ``z_k = U_k + W2 · W1[prev_k]`` with ``prev = [x_a, x*_{a+1}, ...]`` (teacher forced) and
``U^t`` the frozen target's logits. The L1 distance is DeepSpec's ``l1_loss`` (twice the total
variation distance). ``1 − ½‖p_d − p_t‖₁`` is the acceptance probability of a draft token under
rejection sampling at T = 1; its cumulative product summed over the block (+1) is the
teacher-forced expected tau that the evaluation logs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    decay: float = 4.0          # w_k = exp(-k / decay); 0 disables the decay
    confidence: float = 1.0     # weight of the confidence BCE (when a confidence head trains)


def sample_anchors(batch: int, seq_len: int, num_anchors: int, generator: torch.Generator,
                   device) -> Tensor:
    """Anchors [B, A]: uniform without replacement per row among ``0 .. T-2`` (each has a label),
    sorted ascending."""
    if not 0 < num_anchors <= seq_len - 1:
        raise ValueError(f"num_anchors {num_anchors} must be in [1, seq_len - 1 = {seq_len - 1}]")
    keys = torch.rand(batch, seq_len - 1, generator=generator)
    return keys.argsort(1)[:, :num_anchors].sort(1).values.to(device)


def sample_masked_anchors(label_mask: Tensor, num_anchors: int,
                          generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Anchors where the loss mask allows: anchor ``a`` needs ``label_mask[a + 1]`` (its first
    label is a trained-on token, e.g. a generated one). label_mask [B, T] bool ->
    anchors [B, A] (sorted; 0 where unused) and ok [B, A] bool, A = min(num_anchors, the most
    allowed anchors of a row): each row takes min(num_anchors, its allowed count) anchors
    uniformly without replacement."""
    B, T = label_mask.shape
    allowed = label_mask[:, 1:].cpu()                                          # [B, T-1]
    A = max(1, min(num_anchors, int(allowed.sum(1).max())))
    keys = torch.where(allowed, torch.rand(B, T - 1, generator=generator), 2.0)
    idx = keys.argsort(1)[:, :A]                                               # allowed first
    ok = allowed.gather(1, idx)
    anchors = torch.where(ok, idx, T).sort(1).values                           # unused last
    ok = anchors < T
    return torch.where(ok, anchors, 0).to(label_mask.device), ok.to(label_mask.device)


def block_labels(tokens: Tensor, anchors: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """-> labels [B, A, N] (``x_{a+1+k}``, 0 where out of range) and valid [B, A, N] bool
    (in range, cumulative)."""
    T = tokens.shape[1]
    idx = anchors[..., None] + 1 + torch.arange(block_size, device=tokens.device)   # [B, A, N]
    valid = idx < T                               # monotone in k, so already a cumulative mask
    labels = tokens.gather(1, idx.clamp(max=T - 1).flatten(1)).view_as(idx)
    return torch.where(valid, labels, 0), valid


def markov_prev(tokens: Tensor, anchors: Tensor, labels: Tensor) -> Tensor:
    """Teacher-forced previous tokens [B, A, N]: ``[x_a, x*_{a+1}, .., x*_{a+N-1}]``."""
    return torch.cat([tokens.gather(1, anchors)[..., None], labels[..., :-1]], -1)


def _weighted(values: Tensor, w: Tensor) -> Tensor:
    return (values * w).sum() / w.sum().clamp(min=1e-6)


def distill_loss(z: Tensor, labels: Tensor, target_logits: Tensor, w: Tensor,
                 weights: LossWeights) -> dict[str, Tensor]:
    """z, target_logits [..., V]; labels, w [...] -> {'loss', 'ce', 'l1', 'accept_rows'}
    (accept_rows [...]: the T = 1 acceptance probability ``1 − ½‖p_d − p_t‖₁`` per row, detached)."""
    zf = z.float()
    ce = F.cross_entropy(zf.flatten(0, -2), labels.flatten(), reduction="none").view_as(w)
    l1 = (zf.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)     # always reported
    out = {"ce": _weighted(ce, w), "l1": _weighted(l1, w),
           "accept_rows": (1 - 0.5 * l1.detach()).clamp(0, 1)}
    out["loss"] = weights.ce * out["ce"] + (weights.l1 * out["l1"] if weights.l1 else 0.0)
    return out


def position_weights(valid: Tensor, decay: float) -> Tensor:
    """valid [B, A, N] -> w [B, A, N] = exp(-k / decay) * valid."""
    N = valid.shape[-1]
    k = torch.arange(N, device=valid.device, dtype=torch.float32)
    decay_w = torch.exp(-k / decay) if decay > 0 else torch.ones_like(k)
    return valid.float() * decay_w


def block_loss(draft, U: Tensor, tokens: Tensor, anchors: Tensor, target_logits: Tensor,
               weights: LossWeights, label_mask: Tensor | None = None,
               anchor_ok: Tensor | None = None, confidence=None,
               hidden: Tensor | None = None) -> dict[str, Tensor]:
    """U [B, A, N, V] base draft logits; target_logits [B, T, V] of the frozen target.
    label_mask [B, T] (optional): only these tokens are labels; a block row counts while all its
    labels so far are in the mask. anchor_ok [B, A] (optional): unused anchors weigh nothing.
    confidence (a ``ConfidenceHead``, with hidden [B, A, N, d]): adds DeepSpec's confidence BCE
    with weight ``weights.confidence``."""
    B, A, N, V = U.shape
    T = tokens.shape[1]
    labels, valid = block_labels(tokens, anchors, N)
    if label_mask is not None:
        idx = (anchors[..., None] + 1 + torch.arange(N, device=U.device)).clamp(max=T - 1)
        in_mask = label_mask.gather(1, idx.flatten(1)).view_as(idx)
        valid = (valid & in_mask).int().cumprod(-1).bool()
    if anchor_ok is not None:
        valid = valid & anchor_ok[..., None]
    z = U
    prev = markov_prev(tokens, anchors, labels)
    if getattr(draft, "markov_head", None) is not None:
        z = U.float() + draft.markov_head.bias(prev).float()
    rows = (anchors[..., None] + torch.arange(N, device=U.device)).clamp(max=T - 1)     # a + k
    tl = target_logits.gather(1, rows.flatten(1)[..., None].expand(B, A * N, V)).view(B, A, N, V)
    w = position_weights(valid, weights.decay)
    out = distill_loss(z, labels, tl, w, weights)
    if confidence is not None:
        from .confidence import confidence_loss
        c = confidence_loss(confidence(hidden, draft.markov_head.markov_w1(prev)),
                            out["accept_rows"], w)
        out["conf_bce"], out["conf_abs_err"] = c["bce"], c["abs_err"]
        out["loss"] = out["loss"] + weights.confidence * c["bce"]
    acc = out.pop("accept_rows") * valid     # teacher-forced expected tau at T = 1 (DeepSpec's
    tau = acc.cumprod(-1).sum(-1) + 1                                 # tau_probabilistic) [B, A]
    # greedy teacher-forced tau: drafts accepted while argmax(z_k) == argmax(target row)
    hit = (z.argmax(-1) == tl.argmax(-1)) & valid
    tau0 = hit.int().cumprod(-1).sum(-1) + 1.0
    used = valid[..., 0].float()                                      # blocks with >= 1 label
    out["tau_t1"] = (tau * used).sum() / used.sum().clamp(min=1)
    out["tau_t0"] = (tau0 * used).sum() / used.sum().clamp(min=1)
    return out


def causal_lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token CE of logits [B, T, V] on tokens [B, T] (the last position has no label)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())


def ar_draft_loss(logits: Tensor, tokens: Tensor, target_logits: Tensor, weights: LossWeights,
                  block_size: int = 7, label_mask: Tensor | None = None) -> dict[str, Tensor]:
    """The autoregressive draft's objective: the same CE/L1 mix at every position whose label is
    in ``label_mask`` [B, T] (all positions without one). ``tau_t1`` / ``tau_t0`` are the
    teacher-forced expected tau at T = 1 / greedy tau of blocks of ``block_size`` drafts starting
    at every such position (comparable with ``block_loss``'s)."""
    if label_mask is None:
        label_mask = torch.ones_like(tokens, dtype=torch.bool)
    m = label_mask[:, 1:]                                            # [B, T-1]
    out = distill_loss(logits[:, :-1], tokens[:, 1:], target_logits[:, :-1], m.float(), weights)
    acc = out.pop("accept_rows") * m                                 # [B, T-1]
    hit = (logits[:, :-1].argmax(-1) == target_logits[:, :-1].argmax(-1)) & m
    pad = block_size - 1                           # blocks near the end see zeros past T
    acc, hit = F.pad(acc, (0, pad)), F.pad(hit.int(), (0, pad))
    used = m.float()
    tau1 = acc.unfold(1, block_size, 1).cumprod(-1).sum(-1) + 1      # [B, T-1]
    tau0 = hit.unfold(1, block_size, 1).cumprod(-1).sum(-1) + 1.0
    out["tau_t1"] = (tau1 * used).sum() / used.sum().clamp(min=1)
    out["tau_t0"] = (tau0 * used).sum() / used.sum().clamp(min=1)
    return out


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to ``peak`` then cosine decay to ``floor * peak`` at ``total``
    (``floor`` 0: DeepSpec's cosine to 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
