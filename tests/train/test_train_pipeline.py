"""End to end at toy scale: `dspark-trt train` writes checkpoints the runtime loads, the pair is
lossless, and the acceptance benchmark runs on them."""
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dspark_trt import LLM, SamplingParams
from dspark_trt.train.ar_eval import ar_speculative_generate
from dspark_trt.train.checkpoints import load_ar_draft
from dspark_trt.train.corpus import stdlib_dir
from dspark_trt.train.pipeline import SUMMARY, train_all
from dspark_trt.train.recipe import Schedule, get_recipe

ROOT = Path(__file__).resolve().parents[2]
TRAIN_FILES = ["bisect.py", "colorsys.py", "keyword.py", "glob.py", "fnmatch.py", "shlex.py"]
HELD_FILES = ["textwrap.py", "heapq.py"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    for name in TRAIN_FILES + HELD_FILES:
        shutil.copy(stdlib_dir() / name, root / name)
    sched = Schedule(budget_share=0.25, batch_size=4, seq_len=64, lr=3e-3, warmup=2, steps=3,
                     num_anchors=8, eval_points=1)
    recipe = dataclasses.replace(get_recipe("v1-smoke"), vocab_size=400, target=sched, dspark=sched,
                                 dflash=sched, ar=sched, eval_windows=2)
    out = tmp_path_factory.mktemp("run")
    train_all(recipe, out, device="cpu", stdlib_root=root, log=lambda m: None)
    return out


def test_outputs_and_checkpoint_format(run_dir):
    for sub in ("target", "draft", "dflash", "ar_draft"):
        assert (run_dir / sub / "config.json").exists() and (run_dir / sub / "model.safetensors").exists()
    for f in ("generation_config.json", "tokenizer.json"):
        assert (run_dir / "target" / f).exists()
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert set(summary["models"]) == {"target", "dspark", "dflash", "ar_draft"}
    assert all(m["total_steps"] == 3 and len(m["train_loss"]) == 3 for m in summary["models"].values())
    assert len(summary["data"]["corpus"]["files_sha256"]) == 64
    with safe_open(str(run_dir / "draft" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert "markov_head.markov_w1.weight" in names and not {"embed_tokens.weight", "lm_head.weight"} & names
    cfg = json.loads((run_dir / "draft" / "config.json").read_text())
    assert (cfg["block_size"], cfg["mask_token_id"], cfg["markov_rank"]) == (7, 1, 16)
    assert json.loads((run_dir / "dflash" / "config.json").read_text())["markov_rank"] == 0


def test_trained_pair_is_lossless_and_ar_eval_matches_target(run_dir):
    llm = LLM.from_checkpoints(run_dir / "target", run_dir / "draft", device="cpu",
                               num_spec_tokens=4, max_batch_size=2, max_seq_len=96)
    prompts = ["def f(x):\n    return", "import os\n"]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref = llm.generate(prompts, sp, speculative=False)
    spec = llm.generate(prompts, sp)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ref]
    ar = load_ar_draft(run_dir / "ar_draft")
    res = ar_speculative_generate(llm.target, ar, [llm.encode(p) for p in prompts], 3, 0.0, 12, [0, 1])
    assert [ids for ids, _ in res] == [o.output_ids for o in ref]
    assert all(1 <= st.tau <= 4 and sum(st.accepted) + st.rounds >= 12 for _, st in res)


def test_acceptance_benchmark_runs(run_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import acceptance
    acceptance.main(["--run-dir", str(run_dir), "--device", "cpu", "--num-prompts", "2",
                     "--min-len", "8", "--max-len", "16", "--max-new-tokens", "6",
                     "--block-sizes", "2", "--temperatures", "0,1", "--speed-prompts", "1",
                     "--tag", "test", "--results-dir", str(tmp_path)])
    res = json.loads((tmp_path / "acceptance-test.json").read_text())
    rows = {(r["draft"], r["temperature"]) for r in res["rows"]}
    assert rows == {(d, t) for d in ("DSpark", "DFlash", "AR (1 layer)") for t in (0.0, 1.0)}
    assert all(r["greedy_equals_target"] == 2 for r in res["rows"] if r["temperature"] == 0)
    assert res["speed_batch1"]["speedup"] > 0 and "| DSpark | 2 | 0 |" in res["table_markdown"]
