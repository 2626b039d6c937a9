"""DeepSeek-V4 tensor and expert parallelism over gloo (2 CPU processes) reproduce one process.

Tiny V4 pair in float64 from a fixed seed (every layer kind: SWA, CSA with indexer, HCA; hash and
score routing). The prompt crosses the window (16) and both compression ratios (4, 16), so the
compressed pools and the indexer's top-k are exercised. TP=1 runs in this process; TP=2 and
EP=2 run in the same two spawned ranks. Logit tolerance: 1e-9 absolute (an all_reduce only
reorders float64 sums, ~1e-15). ``--quantization fp8`` holds the routed experts in MXFP4, whose
tensor-parallel slices must keep whole 32-column scale groups: its TP mode runs the tiny preset
with ``moe_intermediate_size`` 64 (32 per rank; the tiny 32 is refused, test below).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_trt.config import get_preset, register_preset
from dspark_trt.models import build_models
from dspark_trt.parallel import ColumnShardError, init_tp, shard_pair_
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.ports import free_port as _free_port

WORLD = 2
PRESET = "deepseek-v4-tiny-dspark"
PROMPTS = [list(range(3, 43)), [11, 12, 13, 14, 15]]            # 40 and 5 tokens
PRESET_H64 = "deepseek-v4-tiny-h64-dspark"          # tiny with moe_intermediate_size 64
# mode -> (preset, expert_parallel, quantization); "*-fp8": the V4_FP8_MODULES linears in fp8,
# sliced with their scale blocks, and the routed experts in MXFP4 (TP: sliced with their scale
# groups, EP: whole experts), against one process with the same weights
MODES = {"tp": (PRESET, False, None), "ep": (PRESET, True, None), "tp-fp8": (PRESET_H64, False, "fp8"),
         "ep-fp8": (PRESET, True, "fp8")}


def _pair(**target_fields):
    pair = get_preset(PRESET)
    t = dataclasses.replace(pair.target, **target_fields)
    return dataclasses.replace(pair, target=t, draft=dataclasses.replace(pair.draft, backbone=t))


register_preset(PRESET_H64, lambda: _pair(moe_intermediate_size=64))     # also in the spawned ranks


def _llm(tp_size: int, expert_parallel: bool = False, quantization: str | None = None, preset: str = PRESET) -> LLM:
    return LLM.from_preset(preset, dtype=torch.float64, device="cpu", tp_size=tp_size,
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
    w13 = moe.w13 if moe.w13 is not None else moe.w13_packed                     # stacked experts
    return {"logits": logits, "taps": taps,
            "cache_shapes": [tuple(t.shape) for t in nets.target_cache["layers"][1].values()],
            "layout": (attn.heads, attn.groups, w13.shape[0], moe.first_expert, w13.shape[1] // 2),
            "experts_dtype": w13.dtype,
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
        out = {mode: _run(_llm(WORLD, ep, q, preset)) for mode, (preset, ep, q) in MODES.items()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_v4")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    refs = {(preset, q) for preset, _, q in MODES.values()}
    return {(preset, q): _run(_llm(1, quantization=q, preset=preset)) for preset, q in refs}, ranks


def _ref(refs, mode):
    preset, _, q = MODES[mode]
    return refs[(preset, q)]


@pytest.mark.parametrize("mode", list(MODES))
def test_v4_parallel_logits_equal_single_process(results, mode):
    refs, ranks = results
    ref = _ref(refs, mode)
    for r in ranks:
        assert r[mode]["logits"].shape == ref["logits"].shape == (1, len(PROMPTS[0]), 512)
        assert (r[mode]["logits"] - ref["logits"]).abs().max().item() < 1e-9
        assert (r[mode]["taps"] - ref["taps"]).abs().max().item() < 1e-9


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("run", ["spec", "ar", "sampled"])
def test_v4_parallel_outputs_equal_single_process_token_for_token(results, mode, run):
    refs, ranks = results
    ref = _ref(refs, mode)
    assert all(len(o) > 0 for o in ref[run])
    for r in ranks:
        assert r[mode][run] == ref[run]


def test_v4_parallel_layout(results):
    """heads 4 -> 2 and groups 2 -> 1 per rank; TP: 8 experts of intermediate 32 -> 16 (MXFP4:
    64 -> 32); EP: 4 whole experts per rank, rank r holding experts 4r..4r+3; the latent caches
    stay whole; --quantization fp8 keeps the experts packed (uint8) on every rank."""
    refs, ranks = results
    ref = refs[(PRESET, None)]
    assert ref["layout"] == (4, 2, 8, 0, 32) and refs[(PRESET, "fp8")]["experts_dtype"] == torch.uint8
    for rank, r in enumerate(ranks):
        assert r["tp"]["layout"] == (2, 1, 8, 0, 16)
        assert r["ep"]["layout"] == r["ep-fp8"]["layout"] == (2, 1, 4, 4 * rank, 32)
        assert r["tp-fp8"]["layout"] == (2, 1, 8, 0, 32)
        assert r["tp-fp8"]["experts_dtype"] == r["ep-fp8"]["experts_dtype"] == torch.uint8
        assert r["tp"]["cache_shapes"] == r["ep"]["cache_shapes"] == ref["cache_shapes"]


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


def test_mxfp4_experts_refuse_a_tp_slice_inside_a_scale_group():
    """Tiny V4 (moe_intermediate_size 32) with MXFP4 routed experts at TP = 2: each rank's 16 input
    columns of w2 would split a 32-column E8M0 group: refused, naming the weight's shape, before
    any module changes; EP = 2 (whole experts) is accepted."""
    from dspark_trt.checkpoints.quant import quant_mxfp4_u8
    from dspark_trt.models.mxfp4_linear import mxfp4_experts_
    pair = get_preset(PRESET)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    assert mxfp4_experts_(target, quant_mxfp4_u8) == 3 * 8 * pair.target.num_hidden_layers
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ColumnShardError, match=r"routed experts' w2 \(MXFP4, weight \[64, 32\]\) rank 0 of 2: "
                                               r"input features 0\.\.16: an MXFP4 shard must start and end on a "
                                               r"multiple of 32"):
        shard_pair_(pair, target, draft, 0, 2)
    after = target.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    shard_pair_(pair, target, draft, 1, 2, expert_parallel=True)
    assert target.layers[0].ffn.inner.first_expert == 4
