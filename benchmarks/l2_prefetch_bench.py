"""L2 prefetch of the next GEMV's weights during latency-bound kernels, on one GPU (issue #21).

One CUDA graph replays, per weight copy i: a q/k/v-sized GEMV (streams 50 MB through L2), then
optionally ``l2_prefetch(B_i)``, then ``--small`` tiny kernels (stand-ins for the norm, RoPE, cache
write and attention kernels of a decode step at batch 1), then the GEMV on ``B_i``. Copies are
rotated so every GEMV reads cold weights (> 5x L2 in all). Per B shape and small-kernel count: time
per iteration without / with the prefetch, the GEMV on B alone (cold), the small chain alone.

    python benchmarks/l2_prefetch_bench.py [--small 0,2,4,8] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.kernels.l2_prefetch import l2_prefetch  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from skinny_gemm_bench import graph_us  # noqa: E402

PEAK = 4.8e12
NEXT = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 12288)}   # B [N, K]
PREV = (6144, 4096)                                                        # A: the q/k/v projection


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="0,2,4,8")
    ap.add_argument("--next", default=",".join(NEXT))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rotate-mb", type=float, default=400.0)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    rows = []
    for name in args.next.split(","):
        N, K = NEXT[name]
        per = 2 * (N * K + PREV[0] * PREV[1])
        copies = max(2, math.ceil(args.rotate_mb * 2**20 / per))
        A = [torch.randn(*PREV, device=dev).bfloat16() for _ in range(copies)]
        B = [torch.randn(N, K, device=dev).bfloat16() for _ in range(copies)]
        xa = torch.randn(1, PREV[1], device=dev).bfloat16()
        xb = torch.randn(1, K, device=dev).bfloat16()
        t = torch.randn(1, 4096, device=dev)

        def chain(n):
            y = t
            for _ in range(n):
                y = torch.sin(y)
            return y

        def step(i, n, prefetch):
            F.linear(xa, A[i])
            if prefetch:
                l2_prefetch(B[i])
            chain(n)
            return F.linear(xb, B[i])

        ref = F.linear(xb, B[0])
        assert torch.equal(step(0, 2, True), ref)           # a hint: the result is the same
        b_alone = graph_us([lambda i=i: F.linear(xb, B[i]) for i in range(copies)], args.iters)
        for n in (int(s) for s in args.small.split(",")):
            plain = graph_us([lambda i=i: step(i, n, False) for i in range(copies)], args.iters)
            pref = graph_us([lambda i=i: step(i, n, True) for i in range(copies)], args.iters)
            small = graph_us([lambda: chain(n)] * copies, args.iters) if n else 0.0
            row = {"next": name, "N": N, "K": K, "small_kernels": n, "copies": copies, "plain_us": plain,
                   "prefetch_us": pref, "saved_us": plain - pref, "next_gemv_alone_us": b_alone,
                   "next_gemv_alone_pct_hbm": 2 * N * K / (b_alone * 1e-6) / PEAK * 100, "small_chain_us": small}
            rows.append(row)
            print(f"[{time.time() - t0:5.1f}s] next {name:5s} small {n}: plain {plain:7.2f} us, prefetch {pref:7.2f} "
                  f"us (saved {plain - pref:+6.2f}); {name} GEMV alone {b_alone:6.2f} us "
                  f"({row['next_gemv_alone_pct_hbm']:.0f} % HBM), chain {small:5.2f} us", flush=True)
        A = B = None                                         # free the copies
        torch.cuda.empty_cache()
    sha, gpu = provenance.git_sha(), provenance.gpu_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"l2-prefetch-{gpu.replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps({"git_sha": sha, "gpu": gpu, "versions": provenance.versions(),
                                "command": " ".join(sys.argv), "prev_gemv": PREV, "rows": rows,
                                "seconds": time.time() - t0}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
