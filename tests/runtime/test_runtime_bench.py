"""``dspark-trt bench`` pieces that run on CPU: roofline byte counts, target verdicts, a smoke run."""
from __future__ import annotations

import importlib.util
import json

import numpy as np

import pytest
import torch

from dspark_trt.commands.bench import check_targets, roofline
from dspark_trt.runtime import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=2,
                           max_seq_len=32, page_size=8)


def step_bytes(module: torch.nn.Module) -> int:
    """Parameters a decode step reads: all but the embedding table (shared ones counted once)."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters()
               if "embed_tokens" not in n)


def test_roofline_counts_the_weights_a_step_reads(llm):
    r = roofline(llm, B=3, context=10, tbps=1.0)
    assert r["target_weight_bytes"] == step_bytes(llm.target)
    assert r["draft_weight_bytes"] == step_bytes(llm.draft)
    t = llm.pair.target
    assert r["target_kv_read_bytes"] == 3 * 10 * 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 4
    assert r["ar_roofline_ms"] == pytest.approx((r["target_weight_bytes"] + r["target_kv_read_bytes"]) / 1e9)


def test_roofline_of_a_draft_vocabulary_counts_its_rows_only(llm, tmp_path):
    """The draft's head and W1 / W2 over 128 of 512 tokens: 384 rows fewer of each; the target's unchanged."""
    from dspark_trt.commands.draft_vocab import write_draft_vocab
    path = tmp_path / "v.json"
    write_draft_vocab(path, torch.arange(0, 512, 4), 512, {})
    sub = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=2,
                          max_seq_len=32, page_size=8, draft_vocab=str(path))
    full, part = roofline(llm, B=1, context=10, tbps=1.0), roofline(sub, B=1, context=10, tbps=1.0)
    d, r = llm.pair.draft.layer_config().hidden_size, llm.pair.draft.markov_rank
    assert full["draft_weight_bytes"] - part["draft_weight_bytes"] == 4 * 384 * (d + 2 * r)
    assert part["target_weight_bytes"] == full["target_weight_bytes"]
    # an engine built with the set (no modules; the manifest's size): the same count
    from types import SimpleNamespace
    nets = SimpleNamespace(dtype=sub.networks.dtype, num_spec_tokens=sub.networks.num_spec_tokens,
                           draft_vocab_size=128)
    engine = SimpleNamespace(networks=nets, pair=sub.pair, tp_size=1, target=None, draft=None)
    assert roofline(engine, B=1, context=10, tbps=1.0) == part


def test_roofline_of_an_fp8_target_counts_fp8_bytes():
    fp8 = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=2,
                          max_seq_len=32, page_size=8, quantization="fp8")
    r = roofline(fp8, B=1, context=10, tbps=1.0)
    assert r["target_weight_bytes"] == step_bytes(fp8.target)
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.target.parameters())
    full = roofline(LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=2,
                                    max_seq_len=32, page_size=8), B=1, context=10, tbps=1.0)
    assert r["target_weight_bytes"] < full["target_weight_bytes"]


def test_target_verdicts():
    v = check_targets({"ar_roofline_efficiency": 0.9, "verify_over_ar": 1.2, "draft_step_ms": 1.0,
                       "spec_host_overhead": 0.01})
    assert v["ar_step_ge_85pct_of_hbm_roofline"]["met"] is True
    assert v["verify_step_le_1.15x_ar_step"]["met"] is False
    assert v["draft_step_le_1ms"]["met"] is True
    assert v["ge_1.5x_hf_plain_decoding_b1"]["met"] is None          # no HF run: not claimed


def test_bench_smoke_writes_json(tmp_path):
    from dspark_trt.cli import main
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = _run_smoke(main, tmp_path)
    finally:
        torch.set_num_threads(threads)
    _check_smoke(rc, tmp_path, main)


HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _run_smoke(main, tmp_path) -> int:
    # without transformers the compiled peer is asked for and must be skipped with its reason
    return main(["bench", "--model", "qwen3-tiny-dspark", "--random-weights", "--device", "cpu",
               "--batch-sizes", "1,2,4", "--prompt-len", "8", "--gen-len", "6", "--iters", "1",
               "--hf", "none" if HAVE_TRANSFORMERS else "compiled", "--out-dir", str(tmp_path)])


def _check_smoke(rc, tmp_path, main) -> None:
    assert rc == 0
    (path,) = tmp_path.glob("bench-cpu-*.json")
    rep = json.loads(path.read_text())
    assert set(rep["batch"]) == {"1", "2", "4"}
    b1 = rep["batch"]["1"]
    assert 1 <= b1["speculative"]["tau"] <= 5 and b1["autoregressive"]["tau"] is None
    assert b1["projection_at_paper_tau"]["tau"] == 6.17
    assert rep["graphs_skipped"] and rep["git_sha"]
    assert rep["eager_path"] == {"engine": False, "fused_projections": True, "compiled": None}
    if not HAVE_TRANSFORMERS:
        assert "transformers is not installed" in rep["hf_peer"]["skipped"]
    _check_sweep(rep)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / f"{path.stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert rep["plot"].endswith(".png")
    with pytest.raises(SystemExit, match="--random-weights"):
        main(["bench", "--model", "qwen3-tiny-dspark", "--device", "cpu", "--hf", "none"])


def test_heldout_prompts_are_tokenized_stdlib_windows():
    from dspark_trt.commands.bench import make_prompts
    from dspark_trt.commands.common import default_pair_dirs
    dirs = default_pair_dirs()
    if dirs is None:
        pytest.skip("the built-in default pair is not in this checkout")
    pair = LLM.from_checkpoints(*dirs, dtype=torch.float32, device="cpu", max_batch_size=1, max_seq_len=64)
    p = make_prompts(pair, "heldout", 3, 24, seed=0)
    assert p.shape == (3, 24) and p.dtype == np.int64
    assert len({tuple(r) for r in p.tolist()}) == 3                      # three different windows
    text = pair.tokenizer.decode(p[0].tolist())
    assert pair.tokenizer.encode(text).ids[:5] == p[0][:5].tolist()       # real text, not noise
    with pytest.raises(SystemExit, match="tokenizer"):
        make_prompts(LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu",
                                     max_batch_size=1, max_seq_len=16), "heldout", 1, 8, 0)


def test_trained_pair_criterion_is_judged_only_when_reported():
    v = check_targets({"speedup_over_step_model": 0.79})
    assert v["trained_speedup_ge_0.8x_step_model"]["met"] is False
    assert check_targets({})["trained_speedup_ge_0.8x_step_model"]["met"] is None


def test_random_weights_come_from_the_flag_or_the_engine_manifest():
    from types import SimpleNamespace as NS
    from dspark_trt.commands.bench import uses_random_weights
    engine = lambda rw: NS(networks=NS(manifest={"build_options": {"random_weights": rw}}))  # noqa: E731
    assert uses_random_weights(engine(True), NS(random_weights=False))
    assert not uses_random_weights(engine(False), NS(random_weights=False))
    assert uses_random_weights(NS(networks=NS()), NS(random_weights=True))


def test_bench_plot_orders_batches_and_writes_png(tmp_path):
    from tests.support.benchmark_scripts import load_benchmark
    plot_bench = load_benchmark("plot_bench")
    row = lambda ms: {"ar_step_ms": ms, "verify_step_ms": ms + 1, "draft_step_ms": ms / 4,  # noqa: E731
                      "ar_roofline_ms": 1.0, "speculative": {"decode_tokens_per_s": 10 * ms},
                      "autoregressive": {"decode_tokens_per_s": 20 * ms},
                      "projection_at_paper_tau": {"tau": 6.17, "spec_tokens_per_s": 30 * ms}}
    report = {"gpu": "cpu", "git_sha": "x", "model": {"preset": "p"}, "batch": {"16": row(4.0), "1": row(2.0)}}
    s = plot_bench.series(report)
    assert s["batch"] == [1, 16] and s["ar_ms"] == [2.0, 4.0] and s["spec_tps"] == [20.0, 40.0]
    pytest.importorskip("matplotlib")
    out = plot_bench.plot(report, tmp_path / "b.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_sweep(rep: dict) -> None:
    """One row per batch size; the roofline grows by exactly the extra KV bytes / bandwidth."""
    rows = rep["sweep"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    tbps = rep["options"]["hbm_tbps"]
    for r in rows:
        assert r["context_tokens"] == 8 and r["weight_bytes"] == rows[0]["weight_bytes"]
        assert r["kv_read_bytes"] == r["batch_size"] * rows[0]["kv_read_bytes"]
        assert r["ar_roofline_ms"] == pytest.approx((r["weight_bytes"] + r["kv_read_bytes"]) / (tbps * 1e9))
        assert r["ar_roofline_efficiency"] == pytest.approx(r["ar_roofline_ms"] / r["ar_step_ms"])
        assert 0 < r["verify_roofline_efficiency"] and 0 < r["draft_roofline_efficiency"]
        assert rep["batch"][str(r["batch_size"])]["ar_step_ms"] == r["ar_step_ms"]   # old fields kept
    for a, b in zip(rows, rows[1:]):
        assert b["ar_roofline_ms"] - a["ar_roofline_ms"] == pytest.approx(
            (b["kv_read_bytes"] - a["kv_read_bytes"]) / (tbps * 1e9)) and b["kv_read_bytes"] > a["kv_read_bytes"]


def test_sweep_pairs_each_batch_with_the_compiled_hf_run():
    from dspark_trt.commands.bench import batch_sweep
    res = {B: {"ar_step_ms": 2.0 * B, "verify_step_ms": 3.0, "ar_roofline_ms": 1.0,
               "target_weight_bytes": 10, "target_kv_read_bytes": B} for B in (4, 1)}
    hf = {"runs": [{"mode": "compiled", "batch_size": 1, "decode_step_ms": 5.0, "roofline_efficiency": 0.2},
                   {"mode": "eager", "batch_size": 4, "decode_step_ms": 9.0}]}
    rows = batch_sweep(res, hf, 16)
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert rows[0]["ar_speedup_vs_hf_compiled"] == 2.5 and rows[0]["hf_compiled_step_ms"] == 5.0
    assert "hf_compiled_step_ms" not in rows[1]                     # eager runs are not the peer
    assert rows[1]["ar_roofline_efficiency"] == 1.0 / 8.0 and rows[1]["verify_roofline_efficiency"] == 1 / 3


def _peer():
    from dspark_trt.commands.bench import load_hf_peer
    return load_hf_peer()


def test_hf_peer_reads_an_aoti_engines_target_weights_in_hf_names(tmp_path):
    """The engine path's peer: the target network's constants of weights.safetensors, split back."""
    from safetensors.torch import save_file
    from dspark_trt.models.fuse import unfused_state_dict
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=1,
                          max_seq_len=16)
    stored = {f"target.{k}": v.contiguous() for k, v in llm.target.state_dict().items()}
    save_file(stored | {"draft_block.fc.weight": llm.draft.fc.weight}, str(tmp_path / "weights.safetensors"))
    manifest = {"backend": "aoti", "weights": "weights.safetensors",
                "networks": {"target": {"constants": {k: k for k in stored}}}}
    state, source = _peer().engine_target_state(tmp_path, manifest, llm.pair, "cpu")
    want = unfused_state_dict(llm.target)
    assert source == "engine weights file" and set(state) == set(want)
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_hf_peer_rebuilds_a_random_engine_from_its_seed_or_says_why_not(tmp_path):
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=1,
                          max_seq_len=16, seed=7, fuse=False)
    manifest = {"backend": "tensorrt", "dtype": "fp32", "build_options": {"random_weights": True, "seed": 7}}
    state, source = _peer().engine_target_state(tmp_path, manifest, llm.pair, "cpu")
    ref = llm.target.state_dict()
    assert "seed 7" in source and all(torch.equal(state[k], ref[k]) for k in ref)
    manifest["build_options"] = {"checkpoint": "/ckpt/target"}
    with pytest.raises(ValueError, match="give --checkpoint"):
        _peer().engine_target_state(tmp_path, manifest, llm.pair, "cpu")


def test_decode_paths_script_writes_each_path_and_compares_it_with_the_unfused_one(tmp_path, monkeypatch):
    """benchmarks/decode_paths.py (the H200 A/B of issue #21) on CPU, the eager paths only."""
    import runpy
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_paths.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "qwen3-tiny-dspark", "--device", "cpu",
                                      "--dtype", "fp32", "--batch-sizes", "1,2", "--paths",
                                      "eager_unfused,hf_compiled,eager_fused,eager_fused_fp8", "--iters", "1",
                                      "--gen-len", "5",
                                      "--prompt-len", "8", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    (path,) = tmp_path.glob("decode-paths-cpu-*.json")
    rep = json.loads(path.read_text())
    fused = rep["paths"]["eager_fused"]
    assert set(rep["paths"]) == {"eager_unfused", "eager_fused", "eager_fused_fp8"} and set(fused["batch"]) == {"1", "2"}
    fp8 = rep["paths"]["eager_fused_fp8"]                      # the same weights quantised: close, not equal
    assert 0 < fp8["prefill_logits_vs_eager_fused"]["max_abs_diff"] < 0.1 * fp8["prefill_logits_vs_eager_fused"]["ref_max_abs"]
    assert fp8["batch"]["1"]["target_weight_bytes"] < fused["batch"]["1"]["target_weight_bytes"]
    assert fused["prefill_logits_vs_unfused"]["argmax_equal_fraction"] == 1.0       # fp32: same argmax
    assert fused["greedy_ar_equal_prefix_to_unfused"] == len(fused["greedy_ar_row0"])
    assert rep["summary"]["1"]["ar_speedup_over_eager_unfused"]["eager_unfused"] == 1.0
    if not HAVE_TRANSFORMERS:
        assert "not installed" in rep["hf_peer"]["skipped"]


def test_fp8_roofline_bytes_are_the_bytes_an_fp8_target_holds():
    """The roofline of an fp8 target without its modules (an engine) counts what the modules hold:
    fp8 projections, one fp32 scale per 128x128 block (partial blocks included), wide norms and head."""
    from dspark_trt.commands.bench import qwen3_weight_bytes, rank_step_bytes
    from dspark_trt.models import build_models
    from dspark_trt.models.fp8_linear import fp8_linears_
    from tests.support.models import tiny_pair
    pair = tiny_pair(hidden=160, heads=4, kv_heads=2)            # 160 / 320 rows: partial scale blocks
    target, _ = build_models(pair, torch.bfloat16, "cpu", seed=0)
    wide = qwen3_weight_bytes(pair.target, pair.target.num_hidden_layers, 2)
    assert wide == rank_step_bytes(target)
    fp8_linears_(target)
    got = qwen3_weight_bytes(pair.target, pair.target.num_hidden_layers, 2, fp8_projections=True)
    assert got == rank_step_bytes(target) < wide


def test_host_overhead_is_the_median_of_paired_differences():
    """A round that sleeps 8 ms around steps of 1 ms each: its host share is ~6 ms, and one call
    stretched by 200 ms (another job on the machine) does not move it (a mean of 5 would be 40 ms
    higher); never negative."""
    import time

    from dspark_trt.commands.bench import HOST_ITERS, host_overhead_ms
    calls = []

    def round_fn():
        calls.append(1)
        time.sleep(0.008 + (0.2 if len(calls) == 3 else 0.0))

    step = lambda: time.sleep(0.001)  # noqa: E731
    ms = host_overhead_ms(round_fn, (step, step), [1.0, 1.0], 2, cuda=False)
    assert 3.0 < ms < 30.0 and len(calls) == 1 + HOST_ITERS
    assert host_overhead_ms(step, (round_fn,), [8.0], 2, cuda=False) == 0.0
