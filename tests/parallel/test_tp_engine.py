"""Per-rank AOTInductor engines (``build --tp-size 2``) over gloo on CPU: every rank exports and
compiles its shard with the collectives inside (``_c10d_functional`` ops), and the TP=2 engine
generates exactly what the single-process eager model generates (greedy, fp32).

The build runs in the same two spawned ranks as the generation (one process start-up), in the
background (tests/support/prebuilt.py). A smaller tiny pair (3 target layers, 1 draft layer,
N = 2) and the CPU tests' inductor knob (tests/support/aoti_build.py) keep the six compilations short.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_trt.builder.build import BuildOptions, apply_overrides, build_engine
from dspark_trt.engine.manifest import EngineError
from dspark_trt.config import get_preset
from dspark_trt.models import build_models
from dspark_trt.runtime import LLM, SamplingParams

from tests.support import prebuilt
from tests.support.aoti_build import TEST_INDUCTOR_CONFIG
from tests.support.ports import free_port as _free_port

WORLD = 2
MODEL = "qwen3-tiny-dspark"
OVERRIDES = ["num_hidden_layers=3", "draft.num_hidden_layers=1"]
N = 2
SHAPES = dict(max_batch_size=2, max_seq_len=48, page_size=8)
PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 300, 12]]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def _options(out: str) -> BuildOptions:
    # check_toolchain=False: the probe package costs ~20 s; the build's last stage loads the
    # real packages anyway.
    return BuildOptions(model=MODEL, output=out, random_weights=True, dtype="fp32", backend="aoti",
                        device="cpu", seed=0, num_spec_tokens=N, overrides=OVERRIDES,
                        tp_size=WORLD, check_toolchain=False, **SHAPES)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    inductor_config.compile_threads = 1          # two ranks share the cores: no compile pool
    try:
        with inductor_config.patch(TEST_INDUCTOR_CONFIG):        # shorter compiles, same values (fp32)
            build_engine(_options(out), report=lambda m: None)
        llm = LLM.from_engine(out, device="cpu", tp_size=WORLD)
        res = {"tp_size": llm.tp_size, "kv_heads": llm.networks.target_cache[0].shape[2],
               "spec": llm.generate(PROMPTS, GREEDY), "ar": llm.generate(PROMPTS, GREEDY, speculative=False)}
        torch.save({k: [(o.output_ids, o.stats.accepted) for o in v] if k in ("spec", "ar") else v
                    for k, v in res.items()}, f"{out}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def build_and_generate(out: Path) -> None:      # in a background process (tests/support/prebuilt.py)
    mp.spawn(_worker, args=(_free_port(), str(out / "engine")), nprocs=WORLD, join=True)


BUILD = prebuilt.job("tp2-engine", build_and_generate, fixture="built", timeout=1800, procs=WORLD)


@pytest.fixture(scope="module")
def built():
    out = str(BUILD.wait() / "engine")
    return out, [torch.load(f"{out}.rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def eager() -> LLM:
    pair = apply_overrides(get_preset(MODEL), OVERRIDES)
    target, draft = build_models(pair, torch.float32, "cpu", seed=0)
    return LLM(pair, target, draft, num_spec_tokens=N, **SHAPES)


@pytest.mark.slow
def test_tp2_engine_generates_the_single_process_eager_output(built, eager):
    _, ranks = built
    want = {"spec": eager.generate(PROMPTS, GREEDY), "ar": eager.generate(PROMPTS, GREEDY, speculative=False)}
    for r in ranks:
        assert r["tp_size"] == WORLD and r["kv_heads"] == eager.pair.target.num_key_value_heads // WORLD
        for mode in ("spec", "ar"):
            assert [ids for ids, _ in r[mode]] == [o.output_ids for o in want[mode]]
        assert [acc for _, acc in r["spec"]] == [o.stats.accepted for o in want["spec"]]


@pytest.mark.slow
def test_tp2_engine_directory_holds_one_part_per_rank(built):
    out, _ = built
    m = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert m["tp_size"] == WORLD and len(m["ranks"]) == WORLD and "networks" not in m
    for r, part in enumerate(m["ranks"]):
        assert part["weights"] == f"rank{r}/weights.safetensors"
        assert {n["file"] for n in part["networks"].values()} == {
            f"rank{r}/{n}.pt2" for n in ("target", "draft_context", "draft_block")}
    assert all(f"rank{r}/weights.safetensors" in m["files"] for r in range(WORLD))
    assert "--tp-size 2" in m["build_command"]


@pytest.mark.slow
def test_tp2_engine_refuses_the_wrong_world_size(built, monkeypatch):
    out, _ = built
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(EngineError, match="built for tp_size=2, asked for tp_size=1"):
        LLM.from_engine(out, device="cpu", tp_size=1)
    with pytest.raises(EngineError, match="tp_size=2 .* WORLD_SIZE=1: launch with `torchrun --nproc-per-node 2"):
        LLM.from_engine(out, device="cpu")
