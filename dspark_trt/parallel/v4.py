"""Tensor (and expert) parallelism for the DeepSeek-V4 target and its DSpark-V4 draft.

Attention is MLA with one latent KV shared by all heads (MQA), so everything that produces or
stores the latent is replicated and every rank keeps the full latent cache (as vLLM does for
MLA): ``wq_a``/``q_norm``, ``wkv``/``kv_norm``, both compressors and the CSA indexer (its top-k
must see every index head's score). What is per head is split by heads, H/world per rank:

  wq_b        column-parallel (this rank's heads' query rows)
  attn_sink   this rank's heads' sinks (the sink only enters its own head's softmax)
  wo_a        the output groups holding this rank's heads (G/world of the G groups, whose
              H/G heads are contiguous), i.e. rows [r G/world o_lora, (r+1) G/world o_lora)
  wo_b        row-parallel over those groups' low-rank outputs, + one all_reduce

MoE (router replicated, so every rank routes alike), one all_reduce of the layer's output:

  tensor parallel (default)  each routed expert's and the shared expert's intermediate dim split:
                             w1/w3 column-parallel, w2 row-parallel
  expert parallel            routed experts in contiguous blocks of E/world per rank
                             (``MoE.first_expert``); the shared expert split as above

Embedding and head are vocabulary-parallel and shared with the draft; hyper-connections, norms,
the draft's ``main_proj``/``main_norm`` and the Markov head are replicated. fp8 linears
(``--quantization fp8``) are sliced with their scale blocks (``layers.fp8_blocks``), MXFP4 routed
experts with their scale groups: expert parallelism moves whole experts, tensor parallelism needs
``moe_intermediate_size / world`` to be a multiple of 32 (``layers.mxfp4_groups``; refused before
any module changes otherwise).
"""
from __future__ import annotations

from torch import nn

from .layers import (SumOverRanks, VocabParallelEmbedding, VocabParallelHead, check_fp8_shards, check_mxfp4_cols,
                     check_rank, cols, rows, split, vocab_shard)


def _shard_attention_(a: nn.Module, rank: int, world: int) -> None:
    h, g = a.heads // world, a.groups // world
    D, R = a.cfg.head_dim, a.cfg.o_lora_rank
    a.wq_b = rows(a.wq_b, rank * h * D, (rank + 1) * h * D)
    a.attn_sink = nn.Parameter(a.attn_sink.data[rank * h:(rank + 1) * h].clone(), requires_grad=False)
    a.wo_a = rows(a.wo_a, rank * g * R, (rank + 1) * g * R)
    a.wo_b = SumOverRanks(cols(a.wo_b, rank * g * R, (rank + 1) * g * R))
    a.heads, a.groups = h, g


def _split_expert_(e: nn.Module, rank: int, world: int) -> None:
    f = e.w1.out_features // world
    e.w1, e.w3 = rows(e.w1, rank * f, (rank + 1) * f), rows(e.w3, rank * f, (rank + 1) * f)
    e.w2 = cols(e.w2, rank * f, (rank + 1) * f)


def _shard_moe_(moe: nn.Module, rank: int, world: int, expert_parallel: bool) -> nn.Module:
    if expert_parallel:
        n = len(moe.experts) // world
        moe.experts = nn.ModuleList(list(moe.experts)[rank * n:(rank + 1) * n])
        moe.first_expert = rank * n
    else:
        for e in moe.experts:
            _split_expert_(e, rank, world)
    if moe.shared_experts is not None:
        _split_expert_(moe.shared_experts, rank, world)
    return SumOverRanks(moe)


def _check(blocks: list[nn.Module], world: int, expert_parallel: bool) -> None:
    for b in blocks:
        a = b.attn
        h, g = split(a.heads, world, "num_attention_heads"), split(a.groups, world, "o_groups")
        check_fp8_shards("wq_b", a.wq_b, h * a.cfg.head_dim, world)
        check_fp8_shards("wo_b", a.wo_b, g * a.cfg.o_lora_rank, world)
        moe = b.ffn
        if expert_parallel:
            split(len(moe.experts), world, "n_routed_experts")
        elif len(moe.experts):
            f = split(moe.experts[0].w1.out_features, world, "moe_intermediate_size")
            check_mxfp4_cols("routed experts' w2", moe.experts[0].w2, f, world)
        if moe.shared_experts is not None:
            e = moe.shared_experts
            f = split(e.w1.out_features, world, "moe_intermediate_size * n_shared_experts")
            for name, lin in (("shared_experts.w1", e.w1), ("shared_experts.w3", e.w3),
                              ("shared_experts.w2", e.w2)):
                check_fp8_shards(name, lin, f, world)


def shard_v4_(target: nn.Module, draft: nn.Module | None, rank: int, world: int,
              expert_parallel: bool = False) -> None:
    """Shard a loaded ``DeepSeekV4ForCausalLM`` and its ``DSparkV4Draft`` in place for ``rank``
    of ``world``. All divisibility checks run before any module is touched."""
    check_rank(rank, world)
    if world == 1:
        return
    blocks = list(target.layers) + (list(draft.layers) if draft is not None else [])
    _check(blocks, world, expert_parallel)
    V = target.config.vocab_size
    lo, hi = vocab_shard(V, world, rank)
    for b in blocks:
        _shard_attention_(b.attn, rank, world)
        b.ffn = _shard_moe_(b.ffn, rank, world, expert_parallel)
    embed = VocabParallelEmbedding(target.embed, lo, hi)
    head = VocabParallelHead(rows(target.head, lo, hi), V, world)
    target.embed, target.head = embed, head
    if draft is not None:                                  # the draft shares embedding and head
        draft.embed, draft.head = embed, head
