"""Where does a decode step's GPU time go? Kernel breakdown of the target and draft networks.

    python benchmarks/profile_step.py --model qwen3-8b-dspark-block7 [--engine DIR] [--out DIR]

Prefills B random prompts, stages the next round (``steps.stage``), then profiles (torch.profiler,
CUDA activity) eager calls of the AR step (target + sampling; and the AR fallback's, which keeps its
taps), of the target over its verify
window for 1 and N+1 tokens and of the draft step; ``--packed K``: also the target over 1 + K tokens
per row, dense and as the packed verify of B x (1 + K) slots; ``--prefill``: also a whole admission prefill of the B prompts (``Scheduler.step`` of a
fresh scheduler: target, first token, draft context), with the host's top operators. Writes ``profile-<label>.json``: per network
the kernel count, summed kernel time, CUDA-event wall time, and the top kernels by total time,
so the gap between the step time and the HBM roofline can be attributed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.commands.bench import time_ms  # noqa: E402
from dspark_trt.runtime import SamplingParams  # noqa: E402
from dspark_trt.runtime.llm import LLM  # noqa: E402
from dspark_trt.runtime.packed_verify import packed_target  # noqa: E402
from dspark_trt.runtime.steps import verify_window  # noqa: E402


def profile_fn(fn, reps: int = 5, top: int = 25, host: bool = False) -> dict:
    """Kernel table of ``reps`` calls of fn (after 3 warm-ups); times per call in microseconds.
    ``host``: also the host side, the top operators by self CPU time (where a host-bound call
    such as an eager prefill spends its time)."""
    for _ in range(2):
        fn()
    wall_us = time_ms(fn, reps, cuda=True) * 1e3          # one more warm-up, then CUDA events
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((sum(v) / reps, len(v) / reps, n) for n, v in by_name.items()), reverse=True)
    out = {"wall_us": wall_us, "kernels_per_call": len(kernels) / reps,
           "kernel_us_per_call": sum(e.device_time for e in kernels) / reps,
           "top": [{"us_per_call": round(t, 2), "calls": c, "name": n[:160]} for t, c, n in rows[:top]]}
    if host:
        ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        out["host_top"] = [{"self_cpu_us_per_call": round(e.self_cpu_time_total / reps, 1),
                            "calls": e.count / reps, "name": e.key[:160]} for e in ops[:top]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b-dspark-block7", help="a preset, or 'default': the built-in pair")
    ap.add_argument("--engine")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--label", default=None)
    ap.add_argument("--prefill", action="store_true",
                    help="also profile the admission prefill of --batch-size prompts (host side too)")
    ap.add_argument("--packed", type=int, default=None,
                    help="also the packed verify (runtime/packed_verify.py) of K drafts per row, B x (1 + K) "
                         "slots, beside the dense target over the same 1 + K tokens per row")
    ap.add_argument("--window", type=int, default=None,
                    help="also profile the window round's draft step of this many drafts (< N)")
    ap.add_argument("--compile", action="store_true",
                    help="LLM(compile=True): the torch.compile'd layers of the Python API (no engine)")
    ap.add_argument("--quantization", default=None,
                    help="the preset target's weight format (e.g. fp8, fp8-w8a8; see dspark-trt build)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    kw = dict(max_batch_size=a.batch_size, max_seq_len=a.prompt_len + 64, device="cuda")
    if a.engine:
        llm = LLM.from_engine(a.engine, **kw)
    elif a.model == "default":           # the built-in default pair (dspark_trt/assets/default)
        assets = Path(__file__).resolve().parents[1] / "dspark_trt" / "assets" / "default"
        llm = LLM.from_checkpoints(assets / "target", assets / "draft", dtype=torch.bfloat16, compile=a.compile, **kw)
    else:
        llm = LLM.from_preset(a.model, dtype=torch.bfloat16, compile=a.compile, quantization=a.quantization, **kw)
    nets, N = llm.networks, llm.networks.num_spec_tokens
    gen = llm.scheduler()
    prompts = np.random.default_rng(0).integers(0, nets.vocab_size, (a.batch_size, a.prompt_len))
    seqs = [gen.add_request(p.tolist(), SamplingParams(max_new_tokens=32, ignore_eos=True)) for p in prompts]
    gen.step()
    st = llm.steps.eager.stage(gen.round_inputs(seqs))      # the round's inputs, eager steps
    x = st.x
    tokens, pos = verify_window(x, st.drafts)
    out = {"git_sha": provenance.git_sha(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "batch_size": a.batch_size, "prompt_len": a.prompt_len,
           "networks": "engine" if a.engine else ("compiled" if a.compile else "eager"),
           "quantization": a.quantization, "profiles": {}}
    fns = {"ar_step": lambda: llm.steps.eager.ar_step(x, False),      # target + sampling, as the AR round
           # the AR fallback's step: its taps stored in the steps' tap_store (inert rows: the spare row)
           "ar_step_keep_taps": lambda: llm.steps.eager.ar_step(x, False, keep_taps=True),
           "target_1": lambda: nets.target(tokens[:, :1], pos[:, :1], x.table),
           f"target_{N + 1}": lambda: nets.target(tokens, pos, x.table)}
    if a.packed is not None:      # the same tokens per row, dense and packed end to end (issue #25)
        w = a.packed + 1
        lengths = torch.full((a.batch_size,), w, dtype=torch.long, device=nets.device)
        fns[f"target_{w}"] = lambda: nets.target(tokens[:, :w], pos[:, :w], x.table)
        fns[f"target_packed_{a.batch_size * w}"] = lambda: packed_target(nets.target, tokens, pos, x.table, lengths,
                                                                          a.batch_size * w)[:2]
    if N:
        fns["draft_block"] = st.draft
        if a.window:
            fns[f"draft_window_{a.window}"] = lambda: llm.steps.eager.draft_step(x, a.window)
        logits = torch.randn(a.batch_size, N + 1, nets.vocab_size, device=nets.device)
        drafts = torch.zeros(a.batch_size, N, dtype=torch.long, device=nets.device)
        z = torch.randn(a.batch_size, N, nets.vocab_size, device=nets.device)
        fns["verify_greedy"] = lambda: nets.verify(logits, drafts, z, x.temperature, x.seed, x.start)
    if a.prefill:        # Scheduler.step of a new scheduler with waiting requests: the prefill,
        def prefill(steps):  # eager and (CUDA graphs on) from the graph of its padded shape
            g = llm.scheduler()
            g.steps = steps
            for p in prompts:
                g.add_request(p.tolist(), SamplingParams(max_new_tokens=32, ignore_eos=True))
            g.step()
        for kind, steps in {"eager": llm.steps.eager, "graph": llm.steps}.items():
            if kind == "eager" or steps is not llm.steps.eager:
                fns[f"prefill_{kind}_{a.batch_size}x{a.prompt_len}"] = lambda s=steps: prefill(s)
    for name, fn in fns.items():
        out["profiles"][name] = r = profile_fn(fn, host=name.startswith("prefill"))
        print(f"[profile] {name}: wall {r['wall_us']:.0f} us, {r['kernels_per_call']:.0f} kernels, "
              f"kernel sum {r['kernel_us_per_call']:.0f} us", flush=True)
        for row in r["top"][:12]:
            print(f"    {row['us_per_call']:9.1f} us  x{row['calls']:<5g} {row['name'][:110]}", flush=True)
        for row in r.get("host_top", [])[:15]:
            print(f"    host {row['self_cpu_us_per_call']:9.1f} us  x{row['calls']:<5g} {row['name'][:100]}",
                  flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    label = a.label or out["networks"]
    path = Path(a.out) / f"profile-{label}-{out['git_sha']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"[profile] wrote {path}")


if __name__ == "__main__":
    main()
