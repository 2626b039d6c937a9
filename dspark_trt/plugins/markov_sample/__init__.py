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

from ..dispatch import all_greedy_eager_cpu, use_triton
from ..opspec import AotDesc, OnnxNode, OpSpec
from ..rng import STREAM_DRAFT, gumbel


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
    only_greedy = all_greedy_eager_cpu(temperature)       # same tokens, no noise to draw
    for k in range(N):
        bias = w1[prev].to(acc) @ w2.to(acc).T                                      # [B, V]
        z = base_logits[:, k].to(acc) + bias
        if only_greedy:
            x = torch.argmax(z, dim=-1)
        else:
            noise = gumbel(seed, start + k + 1, STREAM_DRAFT, V).to(acc)
            sampled = torch.argmax(z * inv_t[:, None] + noise, dim=-1)
            x = torch.where(greedy, torch.argmax(z, dim=-1), sampled)
        tokens.append(torch.where(live, x, -1))
        logits.append(torch.where(live[:, None], z, 0.0))
        prev = x
    return torch.stack(tokens, 1), torch.stack(logits, 1).to(torch.float32)


@torch.library.triton_op("dspark::markov_sample", mutates_args=())
def markov_sample(base_logits: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor,
                  temperature: Tensor, seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(base_logits):
        from ..kernels.markov_launch import markov_sample_triton
        return markov_sample_triton(base_logits, anchor, w1, w2, temperature, seed, start)   # markov_config
    return markov_sample_ref(base_logits, anchor, w1, w2, temperature, seed, start)


# ---------------------------------------------------------------------------------------------
# Fast mode: candidate-restricted proposal.


def topk_candidates(base_logits: Tensor, chunk: int, per_chunk: int) -> Tensor:
    """U [B, N, V] -> candidate ids [B, N, ceil(V / chunk) * per_chunk] int64: the per_chunk largest
    entries of each vocabulary chunk (ties -> smaller id); -1 where a chunk has no finite entry left."""
    B, N, V = base_logits.shape
    nc = -(-V // chunk)
    x = torch.nn.functional.pad(base_logits.float(), (0, nc * chunk - V), value=float("-inf"))
    vals, loc = x.view(B, N, nc, chunk).sort(dim=-1, descending=True, stable=True)
    vals, loc = vals[..., :per_chunk], loc[..., :per_chunk]
    ids = loc + chunk * torch.arange(nc, device=x.device)[:, None]
    return torch.where(vals > float("-inf"), ids, -1).reshape(B, N, nc * per_chunk)


def markov_sample_topk_ref(base_logits: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor,
                           temperature: Tensor, seed: Tensor, start: Tensor, chunk: int,
                           per_chunk: int) -> tuple[Tensor, Tensor]:
    """Same inputs/outputs as ``markov_sample_ref``, but each step only considers the candidates
    ``topk_candidates(U)`` (the union of per-chunk top-``per_chunk`` base logits, which contains
    the global top-``per_chunk``): ``z_k`` is exact on the candidates and **-inf elsewhere**, and the
    token is sampled from ``softmax(z_k / T)`` over them (argmax at T = 0). This is NOT the
    full-vocabulary sampler: it is a different proposal, and verification stays lossless because
    the stored ``z_k`` is exactly the distribution that was sampled. Inert rows: tokens -1, z 0."""
    B, N, V = base_logits.shape
    live = anchor >= 0
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-6)).float()
    cand = topk_candidates(base_logits, chunk, per_chunk)                      # [B, N, C]
    valid = cand >= 0
    col = cand.clamp(min=0)
    prev = anchor.clamp(min=0)
    tokens, logits = [], []
    for k in range(N):
        bias = torch.einsum("br,bcr->bc", w1[prev].float(), w2[col[:, k]].float())   # [B, C]
        z = base_logits[:, k].float().gather(1, col[:, k]) + bias
        noise = gumbel(seed, start + k + 1, STREAM_DRAFT, V).gather(1, col[:, k])
        score = torch.where(greedy[:, None], z, z * inv_t[:, None] + noise)
        score = score.masked_fill(~valid[:, k], float("-inf"))
        best = score.amax(1, keepdim=True)
        x = torch.where(score == best, col[:, k], V).amin(1)
        zk = torch.full((B, V + 1), float("-inf"), device=z.device)          # column V: dropped
        zk.scatter_(1, torch.where(valid[:, k], col[:, k], V), z)
        tokens.append(torch.where(live, x, -1))
        logits.append(torch.where(live[:, None], zk[:, :V], 0.0))
        prev = x
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.library.triton_op("dspark::markov_sample_topk", mutates_args=())
def markov_sample_topk(base_logits: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor,
                       temperature: Tensor, seed: Tensor, start: Tensor, chunk: int,
                       per_chunk: int) -> tuple[Tensor, Tensor]:
    if use_triton(base_logits):
        from ..kernels.markov_topk import markov_sample_topk_triton
        return markov_sample_topk_triton(base_logits, anchor, w1, w2, temperature, seed, start,
                                         chunk, per_chunk)
    return markov_sample_topk_ref(base_logits, anchor, w1, w2, temperature, seed, start, chunk,
                                  per_chunk)


_MARKOV_INPUTS = (("base_logits", "T"), ("anchor", "L"), ("w1", "W"), ("w2", "W"), ("temperature", "F"),
                  ("seed", "L"), ("start", "L"))
OPS = (
    OpSpec("markov_sample", markov_sample_ref, triton="kernels.markov_launch:markov_sample_triton",
           onnx=OnnxNode(_MARKOV_INPUTS, (("tokens", "L"), ("z", "F"))),
           aot=AotDesc(("T", torch.int64, "T", "T", torch.float32, torch.int64, torch.int64),
                       ("B", "N", "V", "R"), (torch.int64, torch.float32),
                       {"BLOCK_B": 16, "BLOCK_V": 128, "BLOCK_R": 64}, num_warps=4),
           tensorrt=True, export_safe=True),
    OpSpec("markov_sample_topk", markov_sample_topk_ref, triton="kernels.markov_topk:markov_sample_topk_triton",
           onnx=OnnxNode(_MARKOV_INPUTS, (("tokens", "L"), ("z", "F")), {"chunk": "int", "per_chunk": "int"}),
           export_safe=True),
)
