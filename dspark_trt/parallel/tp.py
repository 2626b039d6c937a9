"""Megatron-style tensor parallelism: process group, the Qwen3 target and its DSpark draft.

Every rank holds the full replicated parts (norms, the draft's fc / hidden_norm and Markov head)
and a 1/world slice of the rest, cut *in place* after the weights are loaded:

  attention   q/k/v_proj column-parallel by heads (local H/world, Hkv/world); o_proj row-parallel
              + all_reduce (``RowParallel``)
  MLP         gate/up column-parallel, down row-parallel + all_reduce
  lm_head     vocabulary-parallel; the logits are all-gathered (``VocabParallelHead``) so the
              sampler and the verifier see exactly the [.., V] logits of the single-GPU path
  embedding   vocabulary-parallel: out-of-shard ids read zeros, summed by one all_reduce (exact)

KV caches then hold only the local KV heads (``make_cache`` reads the sharded attention's head
count); the world size is the caller's (``LLM(tp=TPInfo)``), not stored on the modules.
Every rank runs the same scheduler on the same inputs, so all ranks issue the same collectives in
the same order. ``world == 1`` changes nothing and issues no collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .layers import (RowParallel, VocabParallelEmbedding, VocabParallelHead, check_fp8_shards, check_rank,
                     cols, rows, split, vocab_shard)
from .topology import Launch, check_gpus, check_tp_size


@dataclass(frozen=True)
class TPInfo:
    rank: int                   # global rank (RANK)
    world: int                  # WORLD_SIZE: the tensor-parallel size, over every node
    local_rank: int             # LOCAL_RANK: the GPU of this rank on its node
    device: torch.device
    launch: Launch | None = None  # the torchrun variables (None: a TPInfo made by hand)


def init_tp(backend: str | None = None, device_type: str | None = None, tp_size: int | None = None,
            what: str | None = None) -> TPInfo:
    """Join the process group described by torchrun's RANK / WORLD_SIZE / LOCAL_RANK (and
    MASTER_ADDR / MASTER_PORT), on one node or several. Backend: nccl on cuda, gloo on cpu; on
    cuda a rank uses ``cuda:LOCAL_RANK``. Checked first, on every rank (``ConfigError``): the
    variables (``topology.Launch``), the node's GPUs, and with ``tp_size`` that WORLD_SIZE is
    ``tp_size`` (``what`` names the option in the message, default ``tp_size=N``). Without
    WORLD_SIZE (or with WORLD_SIZE=1) nothing is initialised: rank 0 of 1."""
    launch = Launch.from_env()
    if tp_size is not None:
        check_tp_size(tp_size, launch, what or f"tp_size={tp_size}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if device_type == "cuda":
        check_gpus(launch, torch.cuda.device_count())
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    if launch.world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device_type == "cuda" else "gloo"),
                                rank=launch.rank, world_size=launch.world,
                                **({"device_id": device} if device_type == "cuda" else {}))
    return TPInfo(launch.rank, launch.world, launch.local_rank, device, launch)


def _shard_decoder_layer_(layer: nn.Module, rank: int, world: int) -> None:
    """One ``Qwen3DecoderLayer``: attention heads and MLP columns/rows of this rank."""
    a = layer.self_attn
    h, hkv, d = split(a.h, world, "num_attention_heads"), split(a.hkv, world, "num_key_value_heads"), a.d
    a.q_proj = rows(a.q_proj, rank * h * d, (rank + 1) * h * d)
    a.k_proj = rows(a.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
    a.v_proj = rows(a.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
    a.o_proj = RowParallel(cols(a.o_proj, rank * h * d, (rank + 1) * h * d))
    a.h, a.hkv = h, hkv
    m = layer.mlp
    f = split(m.gate_proj.out_features, world, "intermediate_size")
    m.gate_proj = rows(m.gate_proj, rank * f, (rank + 1) * f)
    m.up_proj = rows(m.up_proj, rank * f, (rank + 1) * f)
    m.down_proj = RowParallel(cols(m.down_proj, rank * f, (rank + 1) * f))


def _check_layer_fp8_(layer: nn.Module, world: int, q: int, kv: int, f: int) -> None:
    """Every rank's slice of the layer's fp8 projections fits their scale blocks."""
    a, m = layer.self_attn, layer.mlp
    for name, lin, size in (("q_proj", a.q_proj, q), ("k_proj", a.k_proj, kv), ("v_proj", a.v_proj, kv),
                            ("o_proj", a.o_proj, q), ("gate_proj", m.gate_proj, f),
                            ("up_proj", m.up_proj, f), ("down_proj", m.down_proj, f)):
        check_fp8_shards(name, lin, size, world)


def shard_qwen3_(target: nn.Module, draft: nn.Module | None, rank: int, world: int) -> None:
    """Shard a loaded ``Qwen3ForCausalLM`` and its ``DSparkQwen3Draft`` in place for ``rank`` of
    ``world``. All divisibility checks run before any module is touched."""
    check_rank(rank, world)
    if world == 1:
        return
    layers = list(target.model.layers) + (list(draft.layers) if draft is not None else [])
    for layer in layers:                                   # validate everything first
        h = split(layer.self_attn.h, world, "num_attention_heads")
        hkv = split(layer.self_attn.hkv, world, "num_key_value_heads")
        f = split(layer.mlp.gate_proj.out_features, world, "intermediate_size")
        _check_layer_fp8_(layer, world, h * layer.self_attn.d, hkv * layer.self_attn.d, f)
    V = target.config.vocab_size
    lo, hi = vocab_shard(V, world, rank)
    for layer in layers:
        _shard_decoder_layer_(layer, rank, world)
    embed = VocabParallelEmbedding(target.model.embed_tokens, lo, hi)
    head = VocabParallelHead(rows(target.lm_head, lo, hi), V, world)
    if target.config.tie_word_embeddings:
        head.linear.weight = embed.weight
    target.model.embed_tokens, target.lm_head = embed, head
    if draft is not None:                                  # the draft shares embedding and head
        draft.embed_tokens, draft.lm_head = embed, head


def shard_pair_(pair, target: nn.Module, draft: nn.Module | None, rank: int, world: int,
                expert_parallel: bool = False) -> None:
    """Shard target and draft of ``pair`` in place for ``rank`` of ``world`` (by architecture)."""
    arch = pair.target.arch
    if arch == "qwen3":
        if expert_parallel:
            raise ValueError("expert parallelism needs a mixture-of-experts model; the qwen3 "
                             "target is dense (use plain tensor parallelism)")
        shard_qwen3_(target, draft, rank, world)
    elif arch == "deepseek_v4":
        from .v4 import shard_v4_
        shard_v4_(target, draft, rank, world, expert_parallel)
    else:
        raise NotImplementedError(f"tensor parallelism supports qwen3 and deepseek_v4 targets, "
                                  f"not '{arch}'")


def shared_seeds(n: int, device) -> list[int]:
    """``n`` random 62-bit seeds drawn on rank 0 and broadcast, so that requests without a seed
    sample identically on every rank."""
    import random
    t = torch.tensor([random.getrandbits(62) for _ in range(n)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, 0)
    return t.tolist()
