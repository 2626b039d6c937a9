"""Megatron-style tensor parallelism for the Qwen3 target and its DSpark draft.

Every rank holds the full replicated parts (embedding, norms, the draft's fc / hidden_norm and
Markov head) and a 1/world slice of the rest, cut *in place* after the weights are loaded:

  attention   q/k/v_proj column-parallel by heads (local H/world, Hkv/world); o_proj row-parallel
              + all_reduce (``RowParallel``)
  MLP         gate/up column-parallel, down row-parallel + all_reduce
  lm_head     vocabulary-parallel; the logits are all-gathered (``VocabParallelHead``) so the
              sampler and the verifier see exactly the [.., V] logits of the single-GPU path

KV caches then hold only the local KV heads (``make_cache`` divides by the model's ``tp_world``).
Every rank runs the same scheduler on the same inputs, so all ranks issue the same collectives in
the same order. ``world == 1`` changes nothing and issues no collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


class ColumnShardError(ValueError):
    """A dimension that must be split across ranks is not divisible by the world size."""


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def init_tp(backend: str | None = None, device_type: str | None = None) -> TPInfo:
    """Join the process group described by torchrun's RANK / WORLD_SIZE / LOCAL_RANK (and
    MASTER_ADDR / MASTER_PORT). Backend: nccl on cuda, gloo on cpu. Without WORLD_SIZE (or with
    WORLD_SIZE=1) nothing is initialised: rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_type, local) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device_type == "cuda" else "gloo"),
                                rank=rank, world_size=world,
                                **({"device_id": device} if device_type == "cuda" else {}))
    return TPInfo(rank, world, local, device)


class RowParallel(nn.Module):
    """A row-parallel ``nn.Linear`` (its input features are this rank's slice): the partial
    products of all ranks are summed with one all_reduce. [.., in/world] -> [.., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y


class VocabParallelHead(nn.Module):
    """The LM head with this rank's ``ceil(V / world)`` vocabulary rows; the logits of all ranks
    are all-gathered: [.., d] -> [.., V] (the last shard may be short; its padding is dropped)."""

    def __init__(self, linear: nn.Linear, vocab_size: int, world: int):
        super().__init__()
        self.linear, self.vocab_size, self.world = linear, vocab_size, world
        self.shard = -(-vocab_size // world)

    @property
    def weight(self) -> Tensor:
        """This rank's rows [shard or fewer, d] (dtype/device probes of the draft use it)."""
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        local = self.linear(x)                                                   # [.., <= shard]
        if local.shape[-1] < self.shard:
            local = nn.functional.pad(local, (0, self.shard - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, -1)[..., :self.vocab_size]                       # [.., V]


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ColumnShardError(f"{what} = {n} is not divisible by the tensor-parallel size {world}")
    return n // world


def _rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """Column-parallel slice: output features lo..hi of ``linear`` (a fresh, contiguous module)."""
    w = linear.weight.data[lo:hi].clone()
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


def _cols(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """Row-parallel slice: input features lo..hi of ``linear``."""
    w = linear.weight.data[:, lo:hi].clone()
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


def _shard_decoder_layer_(layer: nn.Module, rank: int, world: int) -> None:
    """One ``Qwen3DecoderLayer``: attention heads and MLP columns/rows of this rank."""
    a = layer.self_attn
    h, hkv, d = _split(a.h, world, "num_attention_heads"), _split(a.hkv, world, "num_key_value_heads"), a.d
    a.q_proj = _rows(a.q_proj, rank * h * d, (rank + 1) * h * d)
    a.k_proj = _rows(a.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
    a.v_proj = _rows(a.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
    a.o_proj = RowParallel(_cols(a.o_proj, rank * h * d, (rank + 1) * h * d))
    a.h, a.hkv = h, hkv
    m = layer.mlp
    f = _split(m.gate_proj.out_features, world, "intermediate_size")
    m.gate_proj = _rows(m.gate_proj, rank * f, (rank + 1) * f)
    m.up_proj = _rows(m.up_proj, rank * f, (rank + 1) * f)
    m.down_proj = RowParallel(_cols(m.down_proj, rank * f, (rank + 1) * f))


def shard_qwen3_(target: nn.Module, draft: nn.Module | None, rank: int, world: int) -> None:
    """Shard a loaded ``Qwen3ForCausalLM`` and its ``DSparkQwen3Draft`` in place for ``rank`` of
    ``world``. All divisibility checks run before any module is touched."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of size {world}")
    if world == 1:
        return
    layers = list(target.model.layers) + (list(draft.layers) if draft is not None else [])
    for layer in layers:                                   # validate everything first
        _split(layer.self_attn.h, world, "num_attention_heads")
        _split(layer.self_attn.hkv, world, "num_key_value_heads")
        _split(layer.mlp.gate_proj.out_features, world, "intermediate_size")
    for layer in layers:
        _shard_decoder_layer_(layer, rank, world)
    V = target.config.vocab_size
    shard = -(-V // world)
    head = VocabParallelHead(_rows(target.lm_head, rank * shard, min(V, (rank + 1) * shard)), V, world)
    target.lm_head = head
    target.tp_world = world
    if draft is not None:
        draft.lm_head = head                               # the draft shares the target's head
        draft.tp_world = world


def shared_seeds(n: int, device) -> list[int]:
    """``n`` random 62-bit seeds drawn on rank 0 and broadcast, so that requests without a seed
    sample identically on every rank."""
    import random
    t = torch.tensor([random.getrandbits(62) for _ in range(n)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, 0)
    return t.tolist()
