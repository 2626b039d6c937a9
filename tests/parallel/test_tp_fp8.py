"""Tensor parallelism of an fp8 target (``Fp8Linear`` projections with 128 x 128 block scales) over
gloo, 2 CPU processes: every rank holds float8 slices of the projections with their scale blocks,
and its logits and greedy tokens equal the single process's (float64 compute: the all_reduce only
reorders sums, tolerance 1e-9). A shard that starts inside a scale block and crosses into the
next is refused before any module changes."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_trt.models import build_models
from dspark_trt.models.fp8_linear import Fp8Linear, fp8_linears_
from dspark_trt.parallel import ColumnShardError, TPInfo, init_tp, shard_qwen3_
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import scale_weights_, tiny_pair
from tests.support.ports import free_port

WORLD = 2
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def _models(hidden: int, heads: int, kv_heads: int):
    pair = tiny_pair(vocab=61, hidden=hidden, layers=3, heads=heads, kv_heads=kv_heads, block=4, rank=8)
    target, draft = build_models(pair, torch.float64, "cpu", seed=3)
    scale_weights_(target, 4.0)
    fp8_linears_(target, quantize=True)
    return pair, target, draft


def _llm(world: int, rank: int) -> LLM:
    pair, target, draft = _models(256, 4, 2)     # q: 128 rows per rank; k / v: 64, inside one block
    shard_qwen3_(target, draft, rank, world)
    tp = TPInfo(rank, world, rank, torch.device("cpu")) if world > 1 else None
    return LLM(pair, target, draft, max_batch_size=2, max_seq_len=64, page_size=8, tp=tp)


def _run(llm: LLM) -> dict:
    nets = llm.networks
    tokens = torch.tensor(PROMPTS[0])[None]
    logits, _ = nets.target(tokens, torch.arange(tokens.shape[1])[None], torch.arange(2)[None])
    greedy = SamplingParams(max_new_tokens=16)
    return {"logits": logits,
            "spec": [o.output_ids for o in llm.generate(PROMPTS, greedy, speculative=True)]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tp = init_tp(device_type="cpu")
    try:
        torch.save(_run(_llm(tp.world, tp.rank)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fp8_target_under_tp2_equals_one_process(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ref = _run(_llm(1, 0))
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert (got["logits"] - ref["logits"]).abs().max().item() < 1e-9
        assert got["spec"] == ref["spec"]


def test_shards_keep_float8_slices_with_their_scale_blocks():
    _, full, _ = _models(256, 4, 2)
    for rank in range(WORLD):
        _, target, draft = _models(256, 4, 2)
        shard_qwen3_(target, draft, rank, WORLD)
        a0, a = full.model.layers[0].self_attn, target.model.layers[0].self_attn
        assert isinstance(a.q_proj, Fp8Linear) and a.q_proj.weight.dtype == torch.float8_e4m3fn
        assert tuple(a.q_proj.weight.shape) == (128, 256) and tuple(a.q_proj.weight_scale_inv.shape) == (1, 2)
        assert torch.equal(a.q_proj.weight_scale_inv, a0.q_proj.weight_scale_inv[rank:rank + 1])
        assert tuple(a.k_proj.weight.shape) == (64, 256)               # rows 64r..64r+63: block 0
        assert torch.equal(a.k_proj.weight_scale_inv, a0.k_proj.weight_scale_inv[:1])
        o = a.o_proj.linear                                             # row-parallel: columns
        assert tuple(o.weight.shape) == (256, 128)
        assert torch.equal(o.weight_scale_inv, a0.o_proj.weight_scale_inv[:, rank:rank + 1])
        assert torch.equal(o.weight.view(torch.uint8),
                           a0.o_proj.weight[:, 128 * rank:128 * (rank + 1)].view(torch.uint8))


def test_a_shard_across_a_scale_block_is_refused_before_any_change():
    _, target, draft = _models(192, 2, 2)         # q: 96 rows per rank; rank 1 spans rows 96..191
    before = {n: type(m) for n, m in target.named_modules()}
    with pytest.raises(ColumnShardError, match="q_proj .*rank 1 of 2.*multiple of 128"):
        shard_qwen3_(target, draft, 0, WORLD)
    assert {n: type(m) for n, m in target.named_modules()} == before
