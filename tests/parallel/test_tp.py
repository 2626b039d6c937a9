"""Tensor parallelism over gloo (2 CPU processes) reproduces the single-process model exactly.

float64 tiny pair from a fixed seed; TP=1 is computed in this process, TP=2 in two spawned ranks.
Tolerance for logits: 1e-9 absolute (the all_reduce only reorders float64 sums, ~1e-15).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_trt.models import build_models
from dspark_trt.parallel import ColumnShardError, TPInfo, init_tp, shard_qwen3_
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.ports import free_port as _free_port
from tests.support.models import scale_weights_, tiny_pair

WORLD = 2
VOCAB = 61                      # odd: the last vocabulary shard is short (padding path)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


def _llm(world: int, rank: int) -> LLM:
    pair = tiny_pair(vocab=VOCAB, heads=4, kv_heads=2, block=4, rank=8)
    target, draft = build_models(pair, torch.float64, "cpu", seed=5)
    scale_weights_(target, 4.0)
    shard_qwen3_(target, draft, rank, world)
    tp = TPInfo(rank, world, rank, torch.device("cpu")) if world > 1 else None
    return LLM(pair, target, draft, max_batch_size=2, max_seq_len=64, page_size=8, tp=tp)


def _run(llm: LLM) -> dict:
    """Everything compared between TP=1 and TP=2 (the same calls on every rank)."""
    nets = llm.networks
    tokens = torch.tensor(PROMPTS[2])[None]
    positions = torch.arange(tokens.shape[1])[None]
    table = torch.arange(2)[None]
    logits, taps = nets.target(tokens, positions, table)
    greedy = SamplingParams(max_new_tokens=24)
    sampled = SamplingParams(temperature=1.0, seed=7, max_new_tokens=16)
    ids = lambda outs: [o.output_ids for o in outs]  # noqa: E731
    return {"logits": logits, "taps": taps,
            "kv_heads": (nets.target_cache["k"][0].shape[2], nets.draft_cache["k"][0].shape[2]),
            "spec": ids(llm.generate(PROMPTS, greedy, speculative=True)),
            "ar": ids(llm.generate(PROMPTS, greedy, speculative=False)),
            "sampled": ids(llm.generate(PROMPTS, sampled, speculative=True)),
            "unseeded": ids(llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12)))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tp = init_tp(device_type="cpu")
    assert (tp.rank, tp.world, dist.get_backend()) == (rank, WORLD, "gloo")
    try:
        torch.save(_run(_llm(tp.world, tp.rank)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return _run(_llm(1, 0)), ranks


def test_tp2_target_logits_equal_single_process(results):
    ref, ranks = results
    assert ref["logits"].shape == (1, len(PROMPTS[2]), VOCAB)
    for r in ranks:
        assert r["logits"].shape == ref["logits"].shape
        assert (r["logits"] - ref["logits"]).abs().max().item() < 1e-9
        assert (r["taps"] - ref["taps"]).abs().max().item() < 1e-9


def test_tp2_caches_hold_local_kv_heads(results):
    ref, ranks = results
    assert ref["kv_heads"] == (2, 2)
    assert all(r["kv_heads"] == (1, 1) for r in ranks)


@pytest.mark.parametrize("mode", ["spec", "ar", "sampled"])
def test_tp2_outputs_equal_single_process_token_for_token(results, mode):
    ref, ranks = results
    assert all(len(o) > 0 for o in ref[mode])
    for r in ranks:
        assert r[mode] == ref[mode]


def test_tp2_greedy_speculative_equals_autoregressive(results):
    _, ranks = results
    assert ranks[0]["spec"] == ranks[0]["ar"]


def test_tp2_unseeded_requests_sample_alike_on_every_rank(results):
    _, ranks = results
    assert ranks[0]["unseeded"] == ranks[1]["unseeded"]


def test_indivisible_heads_raise_before_any_change():
    pair = tiny_pair(vocab=VOCAB, heads=4, kv_heads=2)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ColumnShardError, match="num_key_value_heads = 2 .* size 4"):
        shard_qwen3_(target, draft, 0, 4)
    after = target.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        shard_qwen3_(target, draft, 2, 2)


def test_world_one_is_a_no_op():
    pair = tiny_pair(vocab=VOCAB)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    mods = [type(m) for m in target.modules()]
    shard_qwen3_(target, draft, 0, 1)
    kv_heads = target.make_cache(1, 8, torch.float64, "cpu")["k"][0].shape[2]
    assert [type(m) for m in target.modules()] == mods and kv_heads == pair.target.num_key_value_heads


def test_cli_generate_under_torchrun_prints_once_and_matches_single_process():
    import json
    import subprocess
    import sys
    prompt = [7, 8, 9, 10]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "dspark_trt.cli", "generate", "--tp-size", str(WORLD), "--model", "qwen3-tiny-dspark",
           "--device", "cpu", "--dtype", "fp64", "--max-new-tokens", "12", "--json",
           "--prompt-ids", ",".join(map(str, prompt))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, run.stdout                       # rank 0 prints, rank 1 is silent
    ref = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float64, device="cpu")
    expect = ref.generate(prompt, SamplingParams(max_new_tokens=12, seed=0))[0].output_ids
    assert lines[0]["output_ids"] == expect


def test_tp_size_must_match_the_launched_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="tp_size=2 but WORLD_SIZE is 1"):
        LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float64, device="cpu", tp_size=2)


def test_build_options_for_per_rank_engines(monkeypatch):
    from dspark_trt.builder.build import BuildOptions, build_engine
    from dspark_trt.config import ConfigError
    opts = dict(model="qwen3-tiny-dspark", random_weights=True, device="cpu")
    assert BuildOptions(**opts).resolved().tp_size == 1
    assert "--tp-size 2" in BuildOptions(**opts, tp_size=2).resolved().command_line()
    with pytest.raises(ConfigError, match="per-rank engines are built with the aoti backend"):
        BuildOptions(**opts, tp_size=2, backend="tensorrt").resolved()
    with pytest.raises(ConfigError, match="--expert-parallel needs --tp-size > 1"):
        BuildOptions(**opts, expert_parallel=True).resolved()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--tp-size 2 but WORLD_SIZE is 1 .* starts the ranks itself"):
        build_engine(BuildOptions(**opts, tp_size=2, output="/nonexistent/never-written"))
