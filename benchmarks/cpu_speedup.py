"""Wall-clock speedup of speculative over plain decoding with the default pair on this CPU: what
``dspark-trt generate`` does (batch 1, greedy, 128 new tokens), per dtype, on windows of the
stdlib modules the pair never saw; greedy outputs compared token for token.

    python benchmarks/cpu_speedup.py [--dtypes fp32,bf16] [--prompts 6] [--threads 2]

Writes benchmarks/results/cpu-speedup-<sha>.json (git sha, CPU, threads, load average before and
after: other work on the machine slows both modes and is recorded, not corrected).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_trt import LLM, SamplingParams, provenance  # noqa: E402
from dspark_trt.commands.bench import make_prompts  # noqa: E402
from dspark_trt.commands.common import default_pair_dirs  # noqa: E402
from dspark_trt.devices import cpu_bf16_flags  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each prompt once speculative and once plain (after one warm-up of each) -> totals."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0]], sp)
    llm.generate([prompts[0]], sp, speculative=False)
    spec_s = ar_s = 0.0
    equal, taus = 0, []
    for p in prompts:
        t0 = time.perf_counter()
        a = llm.generate([p], sp)[0]
        t1 = time.perf_counter()
        b = llm.generate([p], sp, speculative=False)[0]
        t2 = time.perf_counter()
        spec_s, ar_s = spec_s + t1 - t0, ar_s + t2 - t1
        equal += a.output_ids == b.output_ids
        taus.append(a.stats.tau)
    n = len(prompts) * new_tokens
    return {"speculative_tokens_per_s": n / spec_s, "autoregressive_tokens_per_s": n / ar_s,
            "speedup": ar_s / spec_s, "greedy_equal": equal, "prompts": len(prompts),
            "tau_per_prompt": taus, "tau_mean": sum(taus) / len(taus)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = default_pair_dirs()
    load_before = os.getloadavg()
    result = {"git_sha": provenance.git_sha(), "cpu": cpu_name(), "cpu_bf16": cpu_bf16_flags(),
              "threads": args.threads, "command": " ".join(["python"] + sys.argv),
              "torch": torch.__version__, "batch_size": 1, "new_tokens": args.new_tokens,
              "prompt_len": args.prompt_len, "load_average_before": load_before, "dtypes": {}}
    prompts = None
    for name in args.dtypes.split(","):
        llm = LLM.from_checkpoints(target, draft, device="cpu", dtype=DTYPES[name],
                                   max_batch_size=1, max_seq_len=args.prompt_len + args.new_tokens + 16)
        if prompts is None:                     # the same held-out windows for every dtype
            prompts = make_prompts(llm, "heldout", args.prompts, args.prompt_len, seed=0).tolist()
        r = measure(llm, prompts, args.new_tokens)
        result["dtypes"][name] = r
        print(f"[cpu] {name}: speculative {r['speculative_tokens_per_s']:.1f} tok/s, "
              f"autoregressive {r['autoregressive_tokens_per_s']:.1f} tok/s, x{r['speedup']:.2f}, "
              f"tau {r['tau_mean']:.2f}, greedy equal {r['greedy_equal']}/{r['prompts']}", flush=True)
    result["load_average_after"] = os.getloadavg()
    out = Path(args.results_dir) / f"cpu-speedup-{result['git_sha']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
