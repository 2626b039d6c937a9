"""The Python API's decode step, path by path, in one process (issue #21): ``LLM`` eager modules
with separate q/k/v and gate/up linears (the path before this change), with the engines' fused
projections, fused + ``compile=True`` (inductor, regional), the decode kernel chain (``eager_chain``:
``eager_chain_vocab``: with the draft over ``--draft-vocab-size`` tokens, ``models/draft_vocab.py``;
steps of <= 16 tokens through ``runtime/token_step.py``, larger ones through the eager modules;
``compiled_chain``: the larger ones through the compiled modules, e.g. batch 16's verify of 128
rows, which took the eager modules 13.2 ms against the compiled 8.1 on an H100 at 7915627), and the
compiled HF transformers peer on the same weights. Same preset, seed and prompts for every path. ``<path>_fp8`` (issue #23): the
same path with the target's projections quantised to fp8 (``--quantization fp8``: the fp8 kernel,
q/k/v and gate/up fused), compared with ``<path>`` (prefill logits, greedy prefix); ``<path>_w8a8``
likewise with ``--quantization fp8-w8a8`` (activations quantised per 128-group too).

    CXX=/usr/bin/g++ CC=/usr/bin/gcc python benchmarks/decode_paths.py \\
        --model qwen3-8b-dspark-block7 --batch-sizes 1,16 --out-dir "$OUT"

Per path and batch size: the CUDA-graph step latencies of ``dspark-trt bench`` (AR, verify, draft,
target forward, Markov sampler) with the HBM roofline and its efficiency; per path: prefill logits
against the unfused path's (max |diff|, argmax agreement) and greedy tokens (AR, speculative) of
prompt 0 against the unfused AR ones (equal-prefix lengths: bf16 GEMMs of other shapes may
flip a near-tie of random weights, so these are reported, not asserted). The HF peer
(``hf_compiled`` in ``--paths``, on the weights of the path before it) runs ``generate`` with a
static cache (torch.compile) at each batch size. Writes
``decode-paths-<gpu>-<sha>.json`` after every path (a timeout keeps what was measured); pieces past
``--time-budget-s`` are skipped and listed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402
from dspark_trt.commands.bench import (context_step_latencies, load_hf_peer, make_prompts,  # noqa: E402
                                       roofline, versions)
from dspark_trt.runtime import LLM, SamplingParams  # noqa: E402
from dspark_trt.runtime.compiled import mark_caches_static  # noqa: E402

PATHS = {  # name -> LLM.from_preset options
    "eager_unfused": {"fuse": False},
    "eager_fused": {},
    "compiled": {"compile": True},
    "compiled_skinny": {"compile": True},
    "eager_chain": {},                                 # fused modules + the decode kernel chain (#21)
    "eager_chain_vocab": {},                           # the same, the draft over --draft-vocab-size tokens
    "eager_chain_torch_ops": {},                       # the same with the wider steps' torch elementwise ops
    "compiled_chain": {"compile": True},               # the chain's steps of <= 16 tokens, compiled modules' larger
    "eager_fused_fp8": {"quantization": "fp8"},        # q..down in fp8 e4m3, 128x128 block scales (#23)
    "eager_chain_fp8": {"quantization": "fp8"},        # the chain's GEMVs reading those fp8 weights
    "eager_chain_draftfp8": {"draft_quantization": "fp8"},         # the draft's projections in fp8 (#21)
    "eager_chain_draftfp8_vocab": {"draft_quantization": "fp8"},   # ... and over --draft-vocab-size tokens
    "compiled_fp8": {"compile": True, "quantization": "fp8"},
    "compiled_w8a8": {"compile": True, "quantization": "fp8-w8a8"},   # + activations fp8 per 128-group
}
FP8_SUFFIXES = ("_fp8", "_w8a8")   # a path "<p>_fp8" / "<p>_w8a8" is compared with path "<p>" (same weights, quantised)
# environment a path runs under (restored after it): the opt-in skinny-GEMM decode linears, with
# DSPARK_SKINNY_GEMM_TABLE (a skinny_gemm_bench.py JSON of this GPU) if the caller set one
# the other eager paths and "compiled" pin the modules (the default "auto" runs the chain beside both);
# the eager paths' steps past the chain run the row kernels (models.qwen3.use_row_kernels_) unless
# DSPARK_ROW_KERNELS=0: the unchained eager paths keep the torch ops (the paths before #21's kernels)
NO_ROWS = {"DSPARK_ROW_KERNELS": "0"}
PATH_ENV = {"compiled_skinny": {"DSPARK_SKINNY_GEMM": "1", "DSPARK_DECODE_CHAIN": "0"},
            "eager_chain": {"DSPARK_DECODE_CHAIN": "1"},   # steps of <= 16 tokens: runtime/token_step.py
            "eager_chain_vocab": {"DSPARK_DECODE_CHAIN": "1"},
            "eager_chain_fp8": {"DSPARK_DECODE_CHAIN": "1"},
            "eager_chain_draftfp8": {"DSPARK_DECODE_CHAIN": "1"},
            "eager_chain_draftfp8_vocab": {"DSPARK_DECODE_CHAIN": "1"},
            "eager_chain_torch_ops": {"DSPARK_DECODE_CHAIN": "1", **NO_ROWS},
            "compiled_chain": {"DSPARK_DECODE_CHAIN": "1"},   # (batch 16: verify 128 rows, draft 112)
            "compiled": {"DSPARK_DECODE_CHAIN": "0"},
            **{p: {"DSPARK_DECODE_CHAIN": "0", **NO_ROWS} for p in ("eager_unfused", "eager_fused", "eager_fused_fp8")}}
HF = "hf_compiled"            # the compiled HF peer's place in --paths (on the current path's weights)
STEP_KEYS = ("ar_step_ms", "verify_step_ms", "draft_step_ms", "ar_roofline_ms", "ar_roofline_efficiency")


def first_ids_vocab(preset: str, size: int) -> str:
    """A draft-vocabulary file of the ids 0..size-1 for ``preset`` (``models/draft_vocab.py``)."""
    from dspark_trt.config import get_preset
    from dspark_trt.commands.draft_vocab import write_draft_vocab
    V = get_preset(preset).target.vocab_size
    path = Path(tempfile.gettempdir()) / f"draft-vocab-first-{size}.json"
    write_draft_vocab(path, torch.arange(size), V, {"ids": f"0..{size - 1} (timing only)"})
    return str(path)


def prefill_logits(llm: LLM, ids) -> torch.Tensor:
    """The target's logits [T, V] (fp32) over ``ids`` from a fresh cache of its own."""
    t, T, page = llm.target, len(ids), 64
    pages = -(-T // page)
    cache = t.make_cache(pages, page, llm.dtype, llm.device)
    mark_caches_static(cache)                  # as LLM's own caches under compile
    with torch.inference_mode():
        logits, _ = t(torch.as_tensor(ids, device=llm.device)[None],
                      torch.arange(T, device=llm.device)[None], torch.arange(pages, device=llm.device)[None],
                      cache)
    return logits[0].float()


def logits_diff(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (logits - ref).abs()
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "ref_max_abs": float(ref.abs().max()),
            "argmax_equal_fraction": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_path(name: str, llm: LLM, prompts, sizes: list[int], a, ref: dict | None, out: dict,
                 saved) -> torch.Tensor:
    """Fill ``out`` with path ``name``'s measurements (``saved()`` after each batch size); returns
    its prefill logits of prompt 0."""
    out.update(options=dict(PATHS[name]), compiled=llm.compiled, batch={})
    t0 = time.perf_counter()
    logits = prefill_logits(llm, prompts[0].tolist())
    for B in sizes:
        out["batch"][B] = row = context_step_latencies(llm, prompts[:B], a.gen_len, a.iters,
                                                       a.prompt_len, a.hbm_tbps)
        saved()
        print(f"[paths] {name:14s} B={B:3d} ar {row['ar_step_ms']:.3f} ms "
              f"({row['ar_roofline_efficiency']:.0%} of {row['ar_roofline_ms']:.2f} ms) verify "
              f"{row['verify_step_ms']:.3f} draft {row['draft_step_ms']:.3f}", flush=True)
    sp = SamplingParams(max_new_tokens=a.gen_len, ignore_eos=True)
    out["greedy_ar_row0"] = llm.generate([prompts[0].tolist()], sp, speculative=False)[0].output_ids
    spec = llm.generate([prompts[0].tolist()], sp, speculative=True)[0].output_ids
    out["greedy_spec_equal_prefix_to_own_ar"] = equal_prefix(spec, out["greedy_ar_row0"])
    if ref is not None:
        out["prefill_logits_vs_unfused"] = logits_diff(logits, ref["logits"])
        out["greedy_ar_equal_prefix_to_unfused"] = equal_prefix(out["greedy_ar_row0"], ref["ar"])
    out["seconds"] = time.perf_counter() - t0
    return logits


def run_hf(llm: LLM, prompts, sizes: list[int], a, ref_ar: list[int] | None, deadline: float,
           out: dict, saved) -> None:
    """Fill ``out`` with the compiled HF peer's runs; ``saved()`` after each batch size."""
    peer = load_hf_peer()
    why = peer.transformers_missing_reason()
    if why:
        out["skipped"] = why
        return
    model = peer.build_hf_qwen3(llm.target, llm.pair.target)
    out.update(mode="compiled", runs={}, skipped_batch_sizes=[])
    estimate = a.hf_compile_estimate_s                  # a batch size's compile + 4 generate calls
    for B in sizes:
        if time.perf_counter() + estimate > deadline:
            out["skipped_batch_sizes"].append(B)
            print(f"[paths] HF compiled B={B}: skipped (about {estimate:.0f} s, past --time-budget-s)")
            continue
        t0 = time.perf_counter()
        ids = torch.as_tensor(prompts[:B], device=llm.device)
        r = peer.measure_hf_decode(model, ids, a.gen_len, "compiled")
        hf_ids = r.pop("output_ids")[0]
        roof = roofline(llm, B, a.prompt_len + a.gen_len // 2, a.hbm_tbps)["ar_roofline_ms"]
        r.update(roofline_ms=roof, roofline_efficiency=roof / r["decode_step_ms"])
        if ref_ar:
            r["greedy_equal_prefix_to_unfused_ar"] = equal_prefix(hf_ids, ref_ar)
        out["runs"][B] = r
        saved()
        estimate = time.perf_counter() - t0
        print(f"[paths] HF compiled    B={B:3d} decode step {r['decode_step_ms']:.3f} ms "
              f"(first call {r['first_call_s']:.0f} s)", flush=True)
    del model


def summary(paths: dict, hf: dict, sizes: list[int]) -> dict:
    """Per batch size: each path's step times and the ratios the issue asks about."""
    s = {}
    for B in sizes:
        row = {p: {k: r["batch"][B].get(k) for k in STEP_KEYS} for p, r in paths.items()
               if B in r.get("batch", {})}
        h = hf.get("runs", {}).get(B)
        if h:
            row["hf_compiled"] = {"decode_step_ms": h["decode_step_ms"], "roofline_efficiency": h["roofline_efficiency"]}
        ar = {p: v["ar_step_ms"] for p, v in row.items() if p in paths}
        for base in ("eager_unfused", "compiled"):
            if base in ar:
                row[f"ar_speedup_over_{base}"] = {p: ar[base] / v for p, v in ar.items()}
        if h:
            row["ar_speedup_over_hf_compiled"] = {p: h["decode_step_ms"] / v for p, v in ar.items()}
        s[B] = row
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b-dspark-block7")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--paths", default=f"eager_unfused,compiled,{HF},eager_fused",
                    help=f"what to run, in this order: {', '.join(PATHS)} and {HF} (the pieces past "
                         "--time-budget-s are skipped, so the first ones are the ones that matter)")
    ap.add_argument("--hf", choices=["compiled", "none"], default="compiled")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hbm-tbps", type=float, default=None, help="default: the GPU's own (devices.hbm_bytes_per_s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--compile-backend", default="inductor",
                    help="the 'compiled' path's torch.compile backend (aot_eager: CPU smoke runs)")
    ap.add_argument("--time-budget-s", type=float, default=165.0,
                    help="start no path / HF batch size that would end past this (seconds)")
    ap.add_argument("--hf-compile-estimate-s", type=float, default=45.0,
                    help="expected time of the first HF batch size (compile included); later ones: "
                         "the previous one's")
    ap.add_argument("--draft-vocab-size", type=int, default=32768,
                    help="path eager_chain_vocab: the draft's vocabulary, ids 0..size-1 (random weights: "
                         "which ids does not change the step's time)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    a.hbm_tbps = a.hbm_tbps or hbm_bytes_per_s() / 1e12
    t_start = time.perf_counter()
    deadline = t_start + a.time_budget_s
    sizes = sorted(int(x) for x in a.batch_sizes.split(","))
    names = [p.strip() for p in a.paths.split(",") if p.strip()]
    bad = [p for p in names if p not in PATHS and p != HF]
    if bad:
        raise SystemExit(f"error: unknown path(s) {bad}; choose from {list(PATHS) + [HF]}")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    cuda = torch.device(a.device).type == "cuda"
    report = {"git_sha": provenance.git_sha(), "command": " ".join(sys.argv),
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions(),
              "model": {"preset": a.model, "random_weights": True, "seed": a.seed, "dtype": a.dtype},
              "shapes": {"batch_sizes": sizes, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                         "iters": a.iters, "hbm_tbps": a.hbm_tbps},
              "paths": {}, "hf_peer": {}, "skipped": [],
              "notes": ["steps are CUDA-graph replays at a context of prompt_len tokens (dspark-trt "
                        "bench's step_latencies); efficiency = HBM roofline / measured",
                        "AOTI engine at these dims, earlier run (issue #21): AR step 5.06 ms at B=1"]}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode-paths-{report['gpu'].replace(' ', '-')}-{report['git_sha']}.json"

    def write():
        report["summary"] = summary(report["paths"], report["hf_peer"], sizes)
        report["seconds_total"] = time.perf_counter() - t_start
        path.write_text(json.dumps(report, indent=1, default=str))

    ref, llm, prompts, kept = None, None, None, {}
    for name in names:
        if name == HF:
            if a.hf == "none":
                continue
            if time.perf_counter() > deadline:
                report["skipped"].append(name)
                continue
            try:
                if llm is None:                   # the weights only: the same preset and seed
                    llm = LLM.from_preset(a.model, dtype=dtype, device=a.device, seed=a.seed, fuse=False,
                                          max_batch_size=max(sizes), max_seq_len=a.prompt_len + a.gen_len + 8)
                    prompts = make_prompts(llm, "random", max(sizes), a.prompt_len, a.seed)
                run_hf(llm, prompts, sizes, a, ref and ref["ar"], deadline, report["hf_peer"], write)
            except Exception as e:
                report["hf_peer"]["error"] = f"{type(e).__name__}: {e}"
                print(f"[paths] HF peer: FAILED {type(e).__name__}: {e}", flush=True)
            write()
            continue
        if time.perf_counter() > deadline:
            report["skipped"].append(name)
            continue
        if llm is not None:
            llm = None
            gc.collect()
            torch.cuda.empty_cache() if cuda else None
        opts = dict(PATHS[name])
        if name.endswith("_vocab"):
            opts["draft_vocab"] = first_ids_vocab(a.model, a.draft_vocab_size)
            report["shapes"]["draft_vocab_size"] = a.draft_vocab_size
        if opts.get("compile"):
            opts["compile"] = a.compile_backend
        saved_env = {k: os.environ.get(k) for k in PATH_ENV.get(name, {})}
        os.environ.update(PATH_ENV.get(name, {}))
        try:
            llm = LLM.from_preset(a.model, dtype=dtype, device=a.device, seed=a.seed,
                                  max_batch_size=max(sizes), max_seq_len=a.prompt_len + a.gen_len + 8,
                                  **opts)
            if prompts is None:
                prompts = make_prompts(llm, "random", max(sizes), a.prompt_len, a.seed)
            report["paths"][name] = {}
            logits = measure_path(name, llm, prompts, sizes, a, ref, report["paths"][name], write)
        except Exception as e:                    # one failing path does not lose the others
            import traceback
            report["paths"].setdefault(name, {}).update(error=f"{type(e).__name__}: {e}",
                                                        traceback=traceback.format_exc()[-4000:])
            print(f"[paths] {name}: FAILED {type(e).__name__}: {e}", flush=True)
            write()
            continue
        finally:
            for k, v in saved_env.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if name != "compiled" and "greedy_ar_row0" in report["paths"].get("compiled", {}):
            report["paths"][name]["greedy_ar_equal_prefix_to_compiled"] = equal_prefix(
                report["paths"][name]["greedy_ar_row0"], report["paths"]["compiled"]["greedy_ar_row0"])
        if ref is None and name == "eager_unfused":
            ref = {"logits": logits, "ar": report["paths"][name]["greedy_ar_row0"]}
        wide = next((name[:-len(x)] for x in FP8_SUFFIXES if name.endswith(x)), None)
        if wide in kept:                          # fp8 against the same path on the unquantised weights
            report["paths"][name]["prefill_logits_vs_" + wide] = logits_diff(logits, kept[wide])
            report["paths"][name]["greedy_ar_equal_prefix_to_" + wide] = equal_prefix(
                report["paths"][name]["greedy_ar_row0"], report["paths"][wide]["greedy_ar_row0"])
        if any(name + x in names for x in FP8_SUFFIXES):
            kept[name] = logits
        del logits
        write()
    write()
    for B, row in report["summary"].items():
        print(f"[paths] B={B}: " + json.dumps({k: v for k, v in row.items() if k.startswith("ar_speedup")}))
    print(f"[paths] wrote {path} in {report['seconds_total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
