"""GPU build benchmark: build AOTI engines on CUDA, record time + peak memory, check parity.

    CXX=/usr/bin/g++ python benchmarks/build_gpu.py [qwen3] [v4 | v4-build v4-engine v4-eager] [--git-sha SHA]

* qwen3: ``qwen3-8b-dspark-block7 --random-weights --dtype bf16 --backend aoti`` (weights drawn on
  the GPU), then compiled vs eager on the real shapes with the same seed: a prefill of B=4 x 64
  tokens, one draft step (draft_context + draft_block, greedy) and one verify step (target on
  N+1 tokens): max |logit diff| and token equality; plus the draft-step latency.
* v4 (= v4-build, v4-engine, v4-eager, ~8 minutes on one H200; or separate calls on one machine:
  the engine and its outputs stay under $ENGINE_ROOT between them):
  ``deepseek-v4-flash-dspark --random-weights`` with the target cut to its first layer
  (``--override draft.target_layer_ids=[0] --override num_hidden_layers=1``: the three draft stages
  keep their real dimensions, the draft taps the one target layer; ~55 GB of bf16 weights, the
  most the 64 GB disk holds), max batch 16: build time, peak memory, engine size (v4-build), the draft
  step at real dimensions (draft_block, and the context injection draft_context of N+1 taps) at
  batch 1 and 16, as eager launches and as CUDA-graph replays (v4-engine; the drafts / logits are
  saved next to the engine for v4-eager).
* v4-native: ``deepseek-v4-flash-dspark --random-weights --quantization fp8`` (fp8 projections,
  MXFP4 routed experts) with the target cut to one CSA and one HCA layer (``V4_NATIVE_OVERRIDES``;
  the bf16 draft's 39 GB and the 64 GB disk bound the depth): build, then the target's AR and
  verify steps and the draft step at batch 1 / 16 against the roofline of the bytes each reads
  (``build-deepseek-v4-flash-dspark-native.json``).
* v4-eager: the same networks as eager modules from the same seed, the routed
  experts (a) per expert (eager loop over the chosen experts, host syncs), (b) all experts over
  every token (what CUDA-graph capture of unstacked modules runs), (c) stacked through
  ``dspark::moe_experts`` (eager and graph): draft_block latency, and the drafts / logits of (c)
  and of the engine against (a); then the op alone per launch config at M = 1, 5, 80 tokens.

Each model writes ``build-<model>.json`` (git sha, GPU, command, stage times, peaks, parity) to
$OUT if set, else benchmarks/results/, as soon as it is done (v4-engine adds to v4-build's file);
v4-eager writes ``build-deepseek-v4-flash-dspark-eager.json``. Several V4 steps in one call run as
one child process each (the loaded engine's GPU memory is not all returned, and the engine and the
eager modules each need ~100 GB).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.builder.build import BuildOptions, build_engine  # noqa: E402
from dspark_trt.checkpoints.fp8 import apply_quantization_  # noqa: E402
from dspark_trt.config import PRESETS, get_preset  # noqa: E402
from dspark_trt.config.source import resolve_num_spec_tokens  # noqa: E402
from dspark_trt.models import build_models  # noqa: E402
from dspark_trt.runtime.engine import EngineNetworks  # noqa: E402
from dspark_trt.runtime.networks import EagerNetworks  # noqa: E402
from dspark_trt.runtime.steps import DecodeSteps, DeviceInputs, verify_window  # noqa: E402

ENGINES = Path(os.environ.get("ENGINE_ROOT", "/tmp/dspark-engines"))
RESULTS = Path(os.environ.get("OUT") or Path(__file__).parent / "results")


def git_sha(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown (no .git; pass --git-sha)"


def save(name: str, record: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"build-{name}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"[bench] wrote {path}", flush=True)


def build(opts: BuildOptions) -> dict:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = build_engine(opts, report=lambda s: print(s, flush=True))
    return {"command": opts.command_line(), "wall_seconds": round(time.perf_counter() - t0, 1),
            "stage_seconds": m["build_stats"]["stage_seconds"], "peak_memory": m["build_stats"]["peak_memory"],
            "engine_bytes": sum(f["bytes"] for f in m["files"].values()),
            "ops": {net: spec.get("ops") for net, spec in m.get("networks", {}).items()}}


def time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() (eager launches, no CUDA graph)."""
    out = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out[3:])[reps // 2]


def graph_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of one CUDA-graph replay of fn (captured after two warm-up calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = time_ms(g.replay, reps)
    del g
    return ms


def round_inputs(nets, B: int, T: int, device):
    """Prefill B rows of T random tokens; block table of consecutive pages per row."""
    g = torch.Generator(device="cpu").manual_seed(1)
    pages = nets.max_pages_per_seq
    table = torch.arange(B * pages, device=device).view(B, pages)
    tokens = torch.randint(0, nets.vocab_size, (B, T), generator=g).to(device)
    pos = torch.arange(T, device=device).repeat(B, 1)
    return tokens, pos, table


def draft_and_verify(nets, tokens, pos, table):
    """prefill -> draft_context -> the round's draft step (greedy) -> the target over its verify
    window (``runtime.steps``: ``DecodeSteps.draft_step``, ``verify_window``), its logits kept;
    plus thunks of the draft step and of the next round's context injection (the N+1 verified
    taps)."""
    B, T = tokens.shape
    logits, taps = nets.target(tokens, pos, table)
    anchor = logits[:, -1].argmax(-1)
    nets.draft_context(taps, pos, table)
    dev = tokens.device
    x = DeviceInputs(anchor, torch.full((B,), T, device=dev), torch.arange(B, device=dev),
                     torch.zeros(B, device=dev), torch.ones(B, device=dev), table)
    steps = DecodeSteps(nets)
    drafts, z = steps.draft_step(x)
    vtokens, vpos = verify_window(x, drafts)
    vlogits, vtaps = nets.target(vtokens, vpos, table)
    return {"prefill_logits": logits, "drafts": drafts, "z": z, "verify_logits": vlogits,
            "draft_step": lambda: steps.draft_step(x),
            "context_step": lambda: nets.draft_context(vtaps, vpos, table)}


def draft_flips(got: dict, want: dict) -> dict:
    """Where the drafts of a row first differ, why? Both sides had the same earlier tokens there, so
    their z differ only by what the networks compute differently at that position: rounding, or a
    discrete choice inside them (an MoE routing near-tie changes a token's experts; the top-k
    sampler's candidate sets, per-chunk top-k of the base logits, can change at a near-tie). A flip
    is a *candidate-set* flip when either winner is -inf on the other side; else it is *clear* when
    the eager top-2 margin exceeds twice the max |z diff| over the entries finite on both sides
    (else the z differ by more than the margin: read ``first_flip_max_abs_z_diff`` to tell
    rounding from a changed hidden state)."""
    diff_rows = (got["drafts"] != want["drafts"]).any(1).nonzero().flatten().tolist()
    clear, cand, margins, diffs = 0, 0, [], []
    for b in diff_rows:
        k = int((got["drafts"][b] != want["drafts"][b]).nonzero()[0])
        a, w = got["z"][b, k].float(), want["z"][b, k].float()
        ta, tw = int(got["drafts"][b, k]), int(want["drafts"][b, k])
        if not (torch.isfinite(w[ta]) and torch.isfinite(a[tw])):
            cand += 1
            continue
        both = torch.isfinite(a) & torch.isfinite(w)
        d = float((a[both] - w[both]).abs().max())
        top2 = w.topk(2).values
        m = float(top2[0] - top2[1])
        margins.append(m), diffs.append(d)
        clear += int(m > 2 * d)
    return {"rows_differing": len(diff_rows), "candidate_set_flips": cand, "clear_flips": clear,
            "first_flip_eager_top2_margin": margins, "first_flip_max_abs_z_diff": diffs}


def ops_as_references(manifest: dict) -> list[str]:
    """The dspark ops that some network of the engine runs as PyTorch references."""
    return sorted({op for spec in manifest["networks"].values()
                   for op, how in spec.get("ops", {}).items() if how != "triton kernel"})


def parity(engine_dir: Path, opts: BuildOptions, B: int = 4, T: int = 64) -> dict:
    device = torch.device("cuda")
    nets = EngineNetworks(engine_dir, device=device, max_batch_size=B, max_seq_len=opts.max_seq_len)
    dtype = nets.dtype
    from dspark_trt.builder.build import apply_overrides
    o = opts.resolved()           # the reference: same seed -> same weights, unfused eager modules
    pair = apply_overrides(get_preset(o.model), o.overrides)
    target, draft = build_models(pair, dtype, device, o.seed)
    apply_quantization_(pair, target, dtype, o.quantization)    # an fp8 build: the same fp8 weights
    eager = EagerNetworks(target, draft, nets.num_pages, nets.page_size, device, dtype,
                          o.markov_sampler, nets.num_spec_tokens)
    eager.max_pages_per_seq, eager.vocab_size = nets.max_pages_per_seq, nets.vocab_size
    inputs = round_inputs(nets, B, T, device)
    got, want = draft_and_verify(nets, *inputs), draft_and_verify(eager, *inputs)
    def diff(k: str) -> float:
        """Max |difference| over finite entries; inf entries (the top-k proposal's -inf outside
        its candidates) must sit at the same places, else inf."""
        a, b = got[k].float(), want[k].float()
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return float("inf")
        fin = torch.isfinite(b)
        return float((a[fin] - b[fin]).abs().max())
    argmax_eq = lambda k: float((got[k].argmax(-1) == want[k].argmax(-1)).float().mean())  # noqa: E731

    def clear_flips(k: str) -> int:
        """argmax differences where the eager top-2 margin exceeds twice the max logit diff (a
        flip there is a real error; below it, a near-tie resolved differently by bf16 rounding)."""
        top2 = want[k].float().topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * diff(k)
        return int(((got[k].argmax(-1) != want[k].argmax(-1)) & clear).sum())
    out = {"batch": B, "prompt_tokens": T, "num_spec_tokens": nets.num_spec_tokens,
           "prefill_max_abs_logit_diff": diff("prefill_logits"),
           "prefill_argmax_equal_fraction": argmax_eq("prefill_logits"),
           "draft_tokens_equal_fraction": float((got["drafts"] == want["drafts"]).float().mean()),
           "draft_max_abs_logit_diff": diff("z"),
           "verify_max_abs_logit_diff": diff("verify_logits"),
           "verify_argmax_equal_fraction": argmax_eq("verify_logits"),
           "argmax_flips_beyond_rounding": clear_flips("prefill_logits") + clear_flips("verify_logits"),
           "draft_flips": draft_flips(got, want),
           "ops_as_references": ops_as_references(nets.manifest),
           "draft_step_ms_engine": time_ms(got["draft_step"]),
           "draft_step_ms_eager": time_ms(want["draft_step"])}
    print(json.dumps(out, indent=2), flush=True)
    return out


def parity_when_memory_frees(engine_dir: Path, opts: BuildOptions, wait_s: float = 240.0) -> dict:
    """``parity``, once more after the GPU has room when it ran out of memory: the smoke builds run
    beside the GPU tests' workers (session 24: a parity check failed with 0.4 GB free while other
    processes held 112 GB). Waits up to ``wait_s`` for twice the memory the first try held."""
    try:
        return parity(engine_dir, opts)
    except torch.OutOfMemoryError as e:
        need = 2 * torch.cuda.max_memory_allocated()
        print(f"[bench] parity: out of GPU memory ({str(e)[:120]}); waiting for {need / 2**30:.1f} GiB",
              flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    deadline = time.time() + wait_s
    while torch.cuda.mem_get_info()[0] < need and time.time() < deadline:
        time.sleep(5)
    return {**parity(engine_dir, opts), "retried_after_oom": True}


def run(name: str, opts: BuildOptions, sha: str, check_parity: bool, keep: bool = False) -> None:
    record = {"model": name, "git_sha": sha, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "argv": sys.argv}
    record["build"] = build(opts)
    save(name, record)
    if check_parity:
        record["parity"] = parity_when_memory_frees(Path(opts.output), opts)
    else:
        nets = EngineNetworks(opts.output, device="cuda", max_batch_size=4)
        step = draft_and_verify(nets, *round_inputs(nets, 4, 64, torch.device("cuda")))["draft_step"]
        record["draft_step_ms_engine_b4"] = time_ms(step)
    save(name, record)
    if keep:
        print(f"[bench] engine kept at {opts.output}", flush=True)
    else:
        shutil.rmtree(opts.output, ignore_errors=True)
    torch.cuda.empty_cache()


V4 = "deepseek-v4-flash-dspark"
# GPU smoke builds (benchmarks/gpu_smoke.sh): name -> (preset, overrides, max batch)
SMOKE = {"qwen3-8b-6layers": ("qwen3-8b-dspark-block7", ("num_hidden_layers=6",), 16),
         "v4-tiny": ("deepseek-v4-tiny-dspark", (), 16)}
# builds of the same quantised (name -> (the SMOKE build it quantises, --quantization))
SMOKE_FP8 = {"qwen3-8b-6layers-fp8": ("qwen3-8b-6layers", "fp8"),
             "qwen3-8b-6layers-w8a8": ("qwen3-8b-6layers", "fp8-w8a8"),
             "v4-tiny-fp8": ("v4-tiny", "fp8")}
V4_EAGER = f"{V4}-eager"                   # v4-eager's results file: build-<V4_EAGER>.json
V4_OVERRIDES = ["draft.target_layer_ids=[0]", "num_hidden_layers=1"]
V4_BATCHES = (1, 16)


def v4_step(nets, B: int, T: int = 64) -> dict:
    """One round at batch B (``draft_and_verify``): {drafts, z} of the greedy draft block (copied:
    engine outputs are reused buffers) and thunks of the draft step and the context injection."""
    out = draft_and_verify(nets, *round_inputs(nets, B, T, nets.device))
    return {"drafts": out["drafts"].clone(), "z": out["z"].float().clone(),
            "block": out["draft_step"], "context": out["context_step"]}


def try_ms(timer, fn):
    try:
        return timer(fn)
    except Exception as e:                          # e.g. a capture that fails: record why
        return f"{type(e).__name__}: {str(e)[:300]}"


def compare(got: dict, want: dict) -> dict:
    return {"drafts_equal_fraction": float((got["drafts"] == want["drafts"]).float().mean()),
            "max_abs_logit_diff": float((got["z"] - want["z"]).abs().max()),
            "draft_flips": draft_flips(got, want)}


def v4_latencies(nets, graphs: bool = True, context: bool = True) -> tuple[dict, dict]:
    """-> ({B: {draft_block_ms, [draft_block_graph_ms], [draft_context_ms]}}, {B: outputs})."""
    times, outs = {}, {}
    for B in V4_BATCHES:
        step = v4_step(nets, B)
        t = {"draft_block_ms": time_ms(step["block"])}
        if graphs:
            t["draft_block_graph_ms"] = try_ms(graph_ms, step["block"])
        if context:
            t["draft_context_ms"] = time_ms(step["context"])
        times[B], outs[B] = t, step
        print(f"[bench] B={B}: {t}", flush=True)
    return times, outs


MOE_CONFIGS = [{}, {"block_k": 128}, {"block_n": 128, "block_k": 128, "num_warps": 8},
               {"block_k": 128, "num_stages": 4}, {"block_n": 32, "block_k": 256, "num_stages": 2}]


def moe_op_bench(moe) -> dict:
    """dspark::moe_experts alone on one stacked V4-Flash MoE: median ms per launch config and the
    bandwidth of the chosen experts' weights (M tokens, k random distinct experts each)."""
    from dspark_trt.plugins.kernels.moe import moe_experts_triton
    E, _, d = moe.w13.shape
    k = moe.gate.cfg.num_experts_per_tok
    out = {}
    for M in (1, 5, 80):
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, d, device="cuda", generator=g).to(moe.w13.dtype)
        ids = torch.rand(M, E, device="cuda", generator=g).topk(k, -1).indices
        w = torch.rand(M, k, device="cuda", generator=g)
        read = ids.unique().numel() * (moe.w13[0].numel() + moe.w2[0].numel()) * moe.w13.element_size()
        for i, cfg in enumerate(MOE_CONFIGS):
            ms = try_ms(time_ms, lambda: moe_experts_triton(x, ids, w, moe.w13, moe.w2, 0, moe.limit, **cfg))
            gbs = round(read / ms / 1e6, 1) if isinstance(ms, float) else None
            out[f"M{M}_cfg{i}"] = {"config": cfg, "ms": ms, "chosen_expert_GB_per_s": gbs}
    print(json.dumps(out, indent=1), flush=True)
    return out


def v4_eager(opts: BuildOptions, record: dict, engine_outs: dict | None) -> None:
    """Eager draft step with the routed experts per expert, all experts, and stacked (module doc)."""
    from dspark_trt.builder.build import apply_overrides
    from dspark_trt.models.v4_moe import stack_experts_
    o = opts.resolved()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    target, draft = build_models(apply_overrides(get_preset(o.model), o.overrides), torch.bfloat16, "cuda",
                                 o.seed)
    n = resolve_num_spec_tokens(o.num_spec_tokens, draft.config)
    pages = -(-(o.max_seq_len + n + 1) // o.page_size)        # the engine's layout
    nets = EagerNetworks(target, draft, max(V4_BATCHES) * pages, o.page_size, torch.device("cuda"),
                         torch.bfloat16, o.markov_sampler, n)
    nets.max_pages_per_seq = pages
    r = record.setdefault("eager", {"build_models_seconds": round(time.perf_counter() - t0, 1)})
    per_expert, ref = v4_latencies(nets, graphs=False, context=False)
    r["per_expert"] = per_expert
    save(V4_EAGER, record)
    r["all_experts_graph_ms"] = {B: try_ms(graph_ms, ref[B]["block"]) for B in V4_BATCHES}  # capture: dense path
    print(f"[bench] all experts (graph): {r['all_experts_graph_ms']}", flush=True)
    save(V4_EAGER, record)
    t0 = time.perf_counter()
    r["stacked_layers"] = stack_experts_(target) + stack_experts_(draft)
    r["stack_seconds"] = round(time.perf_counter() - t0, 1)
    r["grouped"], got = v4_latencies(nets, graphs=True, context=True)
    r["grouped_vs_per_expert"] = {B: compare(got[B], ref[B]) for B in V4_BATCHES}
    save(V4_EAGER, record)
    r["moe_op"] = moe_op_bench(draft.layers[0].ffn)
    if engine_outs:
        r["engine_vs_per_expert"] = {B: compare(engine_outs[B], ref[B]) for B in V4_BATCHES}
    r["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
    r["peak_host_gib_whole_run"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 2)
    print(json.dumps(r, indent=2), flush=True)
    save(V4_EAGER, record)


V4_STEPS = ("v4-build", "v4-engine", "v4-eager")
# v4-native: V4-Flash at native precision (fp8 projections, MXFP4 routed experts; the draft bf16),
# the target cut to a CSA (ratio 4) and an HCA (ratio 128) layer, the kinds of 41 of its 43 layers
# (the draft taps both: its fc reads 2 taps, not 3)
V4_NATIVE = f"{V4}-native"
V4_NATIVE_OVERRIDES = ["draft.target_layer_ids=[0,1]", "num_hidden_layers=2", "compress_ratios=[4,128,0,0,0]"]


def target_bytes(nets, batch: int) -> dict:
    """Bytes of the target network's weights, and those one step at ``batch`` tokens reads: the
    embedding only in its rows, the routed experts (stacked, leading dim E) in the expected share
    chosen by ``batch`` x k uniform draws (1 - (1 - k/E)^batch), everything else whole."""
    from safetensors import safe_open
    cfg = nets.pair.target
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    share = 1 - (1 - k / E) ** batch
    stored = set(nets.manifest["networks"]["target"]["constants"].values())
    total = read = 0
    with safe_open(str(nets.engine_dir / nets.manifest["weights"]), "pt") as f:
        for name in stored:
            sl = f.get_slice(name)
            n = int(torch.tensor(sl.get_shape()).prod()) * {"U8": 1, "I8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2,
                                                             "F32": 4, "I32": 4, "I64": 8}[sl.get_dtype()]
            total += n
            routed = ".ffn." in name and "shared" not in name and any(
                name.endswith(s) for s in (".w13", ".w2", ".w13_packed", ".w13_scale", ".w2_packed", ".w2_scale"))
            read += 0 if "embed" in name else n * share if routed else n
    return {"weights_bytes": total, "read_bytes": int(read), "routed_share": round(share, 4)}


def run_v4_native(sha: str, markov_sampler: str, keep: bool, model: str = V4, device: str = "cuda",
                  overrides: list[str] = V4_NATIVE_OVERRIDES) -> None:
    """Build V4-Flash at native precision (``V4_NATIVE_OVERRIDES``), then time the target's AR (1
    token) and verify (N + 1) steps and the draft step at batch 1 and 16 as CUDA-graph replays,
    each against the HBM roofline of the bytes it reads, beside the bf16 lm_head alone."""
    opts = BuildOptions(model=model, output=str(ENGINES / V4_NATIVE), random_weights=True, dtype="bf16",
                        quantization="fp8", max_batch_size=16, max_seq_len=256, backend="aoti", device=device,
                        overrides=overrides, markov_sampler=markov_sampler,
                        check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1")
    record = {"model": model, "git_sha": sha, "gpu": provenance.gpu_name(), "torch": torch.__version__,
              "argv": sys.argv, "overrides": overrides, "quantization": "fp8 (+ MXFP4 routed experts)"}
    try:
        record["build"] = build(opts)
    except Exception as e:
        record["build_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        save(V4_NATIVE, record)
        raise
    save(V4_NATIVE, record)
    gc.collect()
    torch.cuda.empty_cache()
    nets = EngineNetworks(opts.output, device=device, max_batch_size=max(V4_BATCHES), verify_checksums=False)
    d, V = nets.pair.target.hidden_size, nets.vocab_size
    steps = {}
    for B in V4_BATCHES:
        tokens, pos, table = round_inputs(nets, B, 64, nets.device)
        out = draft_and_verify(nets, tokens, pos, table)
        n = out["drafts"].shape[1]
        one, one_pos = out["drafts"][:, :1].contiguous(), torch.full((B, 1), 64, device=nets.device)
        ver, ver_pos = torch.cat([one, out["drafts"]], 1), 64 + torch.arange(n + 1, device=nets.device).repeat(B, 1)
        head = torch.randn(V, d, device=nets.device, dtype=torch.bfloat16)
        h = torch.randn(B, d, device=nets.device, dtype=torch.bfloat16)
        r = {"ar_step_ms": try_ms(graph_ms, lambda: nets.target(one, one_pos, table)),
             "verify_step_ms": try_ms(graph_ms, lambda: nets.target(ver, ver_pos, table)),
             "draft_step_ms": try_ms(graph_ms, out["draft_step"]),
             "lm_head_alone_ms": try_ms(graph_ms, lambda: h @ head.T),
             "ar": target_bytes(nets, B), "verify": target_bytes(nets, B * (n + 1))}
        for kind in ("ar", "verify"):
            ms = r[f"{kind}_step_ms"]
            if isinstance(ms, float):
                r[kind]["roofline_ms"] = round(r[kind]["read_bytes"] / 4.8e9, 4)
                r[kind]["of_hbm_roofline"] = round(r[kind]["roofline_ms"] / ms, 3)
        if isinstance(r["ar_step_ms"], float) and isinstance(r["lm_head_alone_ms"], float):
            layers = nets.pair.target.num_hidden_layers
            r["ar_ms_per_layer_less_head"] = round((r["ar_step_ms"] - r["lm_head_alone_ms"]) / layers, 4)
        steps[B] = r
        print(f"[bench] v4-native B={B}: {json.dumps(r)}", flush=True)
    record.update(steps=steps, engine_bytes=sum(f["bytes"] for f in nets.manifest["files"].values()),
                  ops_as_references=ops_as_references(nets.manifest),
                  peak_gpu_gib_after_load=(round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
                                           if torch.cuda.is_available() else None))
    save(V4_NATIVE, record)
    if not keep:
        shutil.rmtree(opts.output, ignore_errors=True)


def run_v4(sha: str, markov_sampler: str, steps: set[str], keep: bool) -> None:
    """Steps (v4 = all three; several run as one child process each): ``v4-build`` builds the engine
    under $ENGINE_ROOT; ``v4-engine`` loads it, times the draft step, saves its drafts / logits next
    to it and removes it (unless --keep); ``v4-eager``: v4_eager, compared with those outputs when
    present."""
    opts = BuildOptions(model=V4, output=str(ENGINES / V4), random_weights=True, dtype="bf16", max_batch_size=16,
                        max_seq_len=256, check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1",
                        backend="aoti", device="cuda", overrides=V4_OVERRIDES, markov_sampler=markov_sampler)
    outputs = ENGINES / f"{V4}-engine-outputs.pt"
    if len(steps) > 1:            # one process per step: a loaded engine's GPU memory is not all returned
        for step in (st for st in V4_STEPS if st in steps):
            subprocess.run([sys.executable, __file__, step, "--git-sha", sha, "--markov-sampler", markov_sampler,
                            *(["--keep"] if keep else [])], check=True)
        return
    record = {"model": V4, "git_sha": sha, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "argv": sys.argv, "overrides": V4_OVERRIDES, "steps": sorted(steps)}
    earlier = RESULTS / f"build-{V4}.json"                   # v4-engine adds to what v4-build wrote
    built = json.loads(earlier.read_text()) if "v4-engine" in steps and earlier.exists() else {}
    if built.get("git_sha") == sha:
        record = {**built, "argv": sys.argv, "steps": ["v4-build", "v4-engine"]}
    if "v4-build" in steps:
        try:
            record["build"] = build(opts)
        except Exception as e:                      # record it; the eager comparison still runs
            record["build_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        save(V4, record)
        gc.collect()
        torch.cuda.empty_cache()
    if "v4-engine" in steps and (Path(opts.output) / "manifest.json").exists():
        t0 = time.perf_counter()
        nets = EngineNetworks(opts.output, device="cuda", max_batch_size=max(V4_BATCHES),
                              verify_checksums=False)           # the build checked them; saves a 55 GB read
        record["engine_load_seconds"] = round(time.perf_counter() - t0, 1)
        record["engine_bytes"] = sum(f["bytes"] for f in nets.manifest["files"].values())
        record["engine"], outs = v4_latencies(nets)
        record["ops_as_references"] = ops_as_references(nets.manifest)
        torch.save({B: {k: outs[B][k].cpu() for k in ("drafts", "z")} for B in V4_BATCHES}, outputs)
        save(V4, record)
        del nets, outs
        if not keep:
            shutil.rmtree(opts.output, ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()
    elif "v4-engine" in steps:
        record["engine_error"] = f"no engine at {opts.output} (run v4-build first)"
        save(V4, record)
    if "v4-eager" in steps:
        engine_outs = None
        if outputs.exists():
            engine_outs = {B: {k: v.cuda() for k, v in o.items()} for B, o in torch.load(outputs).items()}
        v4_eager(opts, record, engine_outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["qwen3", "v4"],
                    choices=["qwen3", "v4", *V4_STEPS, "v4-native", *SMOKE, *SMOKE_FP8])
    ap.add_argument("--git-sha")
    ap.add_argument("--keep", action="store_true", help="keep the engines (for a following bench)")
    ap.add_argument("--markov-sampler", choices=["exact", "topk"], default="exact")
    a = ap.parse_args()
    sha = git_sha(a.git_sha)
    if "qwen3" in a.which:
        m = "qwen3-8b-dspark-block7"
        run(m, BuildOptions(model=m, output=str(ENGINES / m), random_weights=True, dtype="bf16", max_batch_size=64,
                            check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1",
                            backend="aoti", device="cuda", markov_sampler=a.markov_sampler),
            sha, check_parity=True, keep=a.keep)
    for name in [*SMOKE, *SMOKE_FP8]:
        if name in a.which:
            base, quantization = SMOKE_FP8.get(name, (name, None))
            model, overrides, batch = SMOKE[base]
            run(name, BuildOptions(model=model, output=str(ENGINES / name), random_weights=True, dtype="bf16",
                                   max_batch_size=batch, overrides=list(overrides), backend="aoti",
                                   device="cuda", markov_sampler=a.markov_sampler,
                                   quantization=quantization,
                                   check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1"),
                sha, check_parity=True, keep=a.keep)
    if "v4-native" in a.which:
        run_v4_native(sha, a.markov_sampler, keep=a.keep)
    steps = set(V4_STEPS) if "v4" in a.which else set(a.which) & set(V4_STEPS)
    if steps:
        if V4 not in PRESETS:
            print(f"[bench] preset '{V4}' is not defined on this branch: V4 skipped", flush=True)
            return
        run_v4(sha, a.markov_sampler, steps, keep=a.keep)


if __name__ == "__main__":
    main()
