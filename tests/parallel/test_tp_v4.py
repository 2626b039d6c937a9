"""DeepSeek-V4 tensor and expert parallelism over gloo (2 CPU processes) reproduce one process.

Tiny V4 pair in float64 from a fixed seed (every layer kind: SWA, CSA with indexer, HCA; hash and
score routing). The prompt crosses the window (16) and both compression ratios (4, 16), so the
compressed pools and the indexer's top-k are exercised. TP=1 runs in this process; TP=2 and
EP=2 run in the same two spawned ranks. Logit tolerance: 1e-9 absolute (an all_reduce only
reorders float64 sums, ~1e-15).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_trt.config import get_preset
from dspark_trt.models import build_models
from dspark_trt.parallel import ColumnShardError, init_tp, shard_pair_
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.ports import free_port as _free_port

WORLD = 2
PRESET = "deepseek-v4-tiny-dspark"
PROMPTS = [list(range(3, 43)), [11, 12, 13, 14, 15]]            # 40 and 5 tokens
# mode -> (expert_parallel, quantization); "tp-fp8": the V4_FP8_MODULES linears in fp8, sliced
# with their scale blocks, against one process with the same fp8 weights
MODES = {"tp": (False, None), "ep": (True, None), "tp-fp8": (False, "fp8")}


def _llm(tp_size: int, expert_parallel: bool = False, quantization: str | None = None) -> LLM:
    return LLM.from_preset(PRESET, dtype=torch.float64, device="cpu", tp_size=tp_size,
                           expert_parallel=expert_parallel, quantization=quantization,
                           max_batch_size=2, max_seq_len=96, page_size=16)


def _run(llm: LLM) -> dict:
    """Everything compared with the single process (the same calls on every rank)."""
    nets = llm.networks
    tokens = torch.tensor(PROMPTS[0])[None]
    logits, taps = nets.target(tokens, torch.arange(tokens.shape[1])[None], torch.arange(3)[None])
    greedy = SamplingParams(max_new_tokens=24)
    ids = lambda outs: [o.output_ids for o in outs]  # noqa: E731
    attn, moe = llm.target.layers[1].attn, llm.target.layers[1].ffn
    moe = getattr(moe, "inner", moe)
    return {"logits": logits, "taps": taps,
            "cache_shapes": [tuple(t.shape) for t in nets.target_cache["layers"][1].values()],
            "layout": (attn.heads, attn.groups, moe.w13.shape[0], moe.first_expert,   # stacked experts
                       moe.w13.shape[1] // 2),
            "spec": ids(llm.generate(PROMPTS, greedy, speculative=True)),
            "ar": ids(llm.generate(PROMPTS, greedy, speculative=False)),
            "sampled": ids(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3,
                                                                max_new_tokens=16)))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_tp(device_type="cpu")
    try:
        out = {mode: _run(_llm(WORLD, ep, q)) for mode, (ep, q) in MODES.items()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_v4")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return {None: _run(_llm(1)), "fp8": _run(_llm(1, quantization="fp8"))}, ranks


@pytest.mark.parametrize("mode", list(MODES))
def test_v4_parallel_logits_equal_single_process(results, mode):
    refs, ranks = results
    ref = refs[MODES[mode][1]]
    for r in ranks:
        assert r[mode]["logits"].shape == ref["logits"].shape == (1, len(PROMPTS[0]), 512)
        assert (r[mode]["logits"] - ref["logits"]).abs().max().item() < 1e-9
        assert (r[mode]["taps"] - ref["taps"]).abs().max().item() < 1e-9


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("run", ["spec", "ar", "sampled"])
def test_v4_parallel_outputs_equal_single_process_token_for_token(results, mode, run):
    refs, ranks = results
    ref = refs[MODES[mode][1]]
    assert all(len(o) > 0 for o in ref[run])
    for r in ranks:
        assert r[mode][run] == ref[run]


def test_v4_parallel_layout(results):
    """heads 4 -> 2 and groups 2 -> 1 per rank; TP: 8 experts of intermediate 32 -> 16; EP: 4
    whole experts per rank, rank r holding experts 4r..4r+3; the latent caches stay whole."""
    refs, ranks = results
    ref = refs[None]
    assert ref["layout"] == (4, 2, 8, 0, 32)
    for rank, r in enumerate(ranks):
        assert r["tp"]["layout"] == (2, 1, 8, 0, 16)
        assert r["ep"]["layout"] == (2, 1, 4, 4 * rank, 32)
        assert r["tp"]["cache_shapes"] == r["ep"]["cache_shapes"] == ref["cache_shapes"]


def _pair(**target_fields):
    pair = get_preset(PRESET)
    t = dataclasses.replace(pair.target, **target_fields)
    return dataclasses.replace(pair, target=t, draft=dataclasses.replace(pair.draft, backbone=t))


@pytest.mark.parametrize("fields, world, ep, message", [
    ({}, 4, False, "o_groups = 2 is not divisible by the tensor-parallel size 4"),
    ({"o_groups": 4, "num_attention_heads": 4, "n_routed_experts": 6}, 4, True,
     "n_routed_experts = 6 is not divisible by the tensor-parallel size 4"),
    ({"moe_intermediate_size": 31}, 2, False, "moe_intermediate_size = 31 is not divisible"),
])
def test_v4_indivisible_dims_are_named_before_any_change(fields, world, ep, message):
    pair = _pair(**fields)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ColumnShardError, match=message):
        shard_pair_(pair, target, draft, 0, world, expert_parallel=ep)
    after = target.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_expert_parallel_needs_experts():
    pair = get_preset("qwen3-tiny-dspark")
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    with pytest.raises(ValueError, match="expert parallelism needs a mixture-of-experts model"):
        shard_pair_(pair, target, draft, 0, 2, expert_parallel=True)
