"""dspark::rejection_sample — on-device verification of a drafted block (algorithm doc §4.1).

Greedy rows (temperature 0) accept while ``x_j == argmax(L_j)``. Sampled rows run exact
speculative rejection sampling: accept ``x_j`` when ``u_j · q_j(x_j) < p_j(x_j)`` (probability
``min(1, p/q)``); at the first rejection resample from ``norm(max(p_j − q_j, 0))``; if all N pass,
sample the bonus from ``p_N``. ``p = softmax(L / T)``, ``q = softmax(z / T)`` with ``z`` the stored
corrected draft logits. Noise: (seed, position of the decided token, stream), ACCEPT for ``u``,
RESIDUAL for the resample and the bonus. Rows with ``start < 0`` are inert (0 accepted, token -1).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..dispatch import all_greedy_eager_cpu, use_triton
from ..opspec import AotDesc, OnnxNode, OpSpec
from ..rng import STREAM_ACCEPT, STREAM_RESIDUAL, gumbel, uniform

SAMPLE_KERNEL = os.environ.get("DSPARK_SAMPLE_KERNEL", "1") != "0"   # read at import


def sample_tokens(logits: Tensor, temperature: Tensor, seed: Tensor, position: Tensor) -> Tensor:
    """Sample one token per row of logits [B, V]: argmax at T = 0, else softmax(logits / T) (on a
    GPU one Triton kernel pair, ``kernels/sample.py``, unless ``DSPARK_SAMPLE_KERNEL=0``)."""
    if SAMPLE_KERNEL and use_triton(logits):
        from ..kernels.sample import sample_tokens_triton
        return sample_tokens_triton(logits, temperature, seed, position)
    return sample_tokens_ref(logits, temperature, seed, position)


def sample_tokens_ref(logits: Tensor, temperature: Tensor, seed: Tensor, position: Tensor) -> Tensor:
    """``sample_tokens`` in torch ops (the reference; CPU)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-6)).to(acc)
    noise = gumbel(seed, position, STREAM_RESIDUAL, logits.shape[-1]).to(acc)
    sampled = torch.argmax(logits.to(acc) * inv_t[:, None] + noise, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def rejection_sample_ref(target_logits: Tensor, draft_tokens: Tensor, draft_logits: Tensor,
                         temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    """target_logits [B, N+1, V]; draft_tokens [B, N]; draft_logits z [B, N, V]; temperature,
    seed, start (= anchor position P) [B] -> (accepted [B] int64, next_token [B] int64)."""
    B, N1, V = target_logits.shape
    N = N1 - 1
    acc = torch.promote_types(target_logits.dtype, torch.float32)
    live = start >= 0
    greedy = temperature <= 0
    if all_greedy_eager_cpu(temperature):                # the greedy branch below, alone
        ok = draft_tokens.clamp(min=0) == target_logits[:, :N].argmax(-1)
        accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)
        nxt = target_logits.gather(1, accepted[:, None, None].expand(B, 1, V))[:, 0].argmax(-1)
        return torch.where(live, accepted, 0), torch.where(live, nxt, -1)
    t = torch.where(greedy, 1.0, temperature.clamp(min=1e-6)).to(acc)[:, None, None]
    p = torch.softmax(target_logits.to(acc) / t, dim=-1)                        # [B, N+1, V]
    q = torch.softmax(draft_logits.to(acc) / t, dim=-1)                         # [B, N, V]
    x = draft_tokens.clamp(min=0)[..., None]
    px, qx = p[:, :N].gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]           # [B, N]
    draft_pos = start[:, None] + 1 + torch.arange(N, device=start.device)       # [B, N]
    u = uniform(seed.repeat_interleave(N), draft_pos.reshape(-1), STREAM_ACCEPT, 1).view(B, N)
    ok = torch.where(greedy[:, None], x[..., 0] == target_logits[:, :N].argmax(-1),
                     u.to(acc) * qx < px)
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)                  # [B]

    row = accepted[:, None, None].expand(B, 1, V)
    p_row = p.gather(1, row)[:, 0]                                              # [B, V]
    q_row = torch.cat([q, q.new_zeros(B, 1, V)], 1).gather(1, row)[:, 0]        # 0 at the bonus row
    resid = (p_row - q_row).clamp(min=0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 1e-12, resid, p_row)
    noise = gumbel(seed, start + accepted + 1, STREAM_RESIDUAL, V).to(acc)
    sampled = torch.argmax(torch.log(resid) + noise, dim=-1)
    greedy_next = target_logits.gather(1, row)[:, 0].argmax(-1)
    nxt = torch.where(greedy, greedy_next, sampled)
    return torch.where(live, accepted, 0), torch.where(live, nxt, -1)


@torch.library.triton_op("dspark::rejection_sample", mutates_args=())
def rejection_sample(target_logits: Tensor, draft_tokens: Tensor, draft_logits: Tensor,
                     temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(target_logits):
        from ..kernels.rejection import rejection_sample_triton
        return rejection_sample_triton(target_logits, draft_tokens, draft_logits, temperature, seed, start)
    return rejection_sample_ref(target_logits, draft_tokens, draft_logits, temperature, seed, start)


def apply_top_p(logits: Tensor, temperature: Tensor, top_p: Tensor) -> Tensor:
    """Mask logits [B, ..., V] outside the nucleus of softmax(logits / T) per row (top_p [B]).

    No host synchronisation (capturable in a CUDA graph); callers skip it when every row has
    top_p = 1.
    """
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1]).float()
    t = torch.where(temperature <= 0, 1.0, temperature.clamp(min=1e-6))[:, None, None]
    sp, order = torch.softmax(flat / t, -1).sort(-1, descending=True)
    keep_sorted = (sp.cumsum(-1) - sp) < top_p[:, None, None]          # always keeps the top entry
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep.reshape(shape), float("-inf"))


OPS = (
    OpSpec("rejection_sample", rejection_sample_ref, triton="kernels.rejection:rejection_sample_triton",
           onnx=OnnxNode((("target_logits", "T"), ("draft_tokens", "L"), ("draft_logits", "F"),
                          ("temperature", "F"), ("seed", "L"), ("start", "L")),
                         (("accepted", "L"), ("next_token", "L"))),
           aot=AotDesc(("T", torch.int64, torch.float32, torch.float32, torch.int64, torch.int64), ("N", "V"),
                       (torch.int64, torch.int64), {"BLOCK_V": 2048}, num_warps=8),
           tensorrt=True,
           reference_reason="the verifier has no weights: the runtime calls the op directly, "
                            "outside the compiled networks"),
)
