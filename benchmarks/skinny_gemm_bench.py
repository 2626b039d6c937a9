"""Decode-shape GEMM on one GPU (issue #21): cuBLAS (``F.linear``) vs the skinny-GEMM Triton kernel
(``dspark_trt/plugins/kernels/skinny_gemm.py``) over a small config sweep, for the Qwen3-8B
projection shapes and the draft's fc at M = 1, 8, 16, 32, 64, 128 tokens.

Timing: every call is replayed in a CUDA graph (the engine's regime; no Python launch cost). Weights
smaller than ``--rotate-mb`` (default 256 MB, > 5x the H200's 50 MB L2) are copied until the copies
total that much; one graph runs the GEMM once on every copy in turn, so each call reads its weights
from HBM. Time per call = median over ``--iters`` replays (CUDA events) / copies. Bandwidth = (weight
+ x + y bytes) / time, and % of 4.8 TB/s. Each config is checked against ``F.linear`` first.

Writes ``skinny-gemm-<gpu>-<sha>.json`` into $OUT (else benchmarks/results/) with every
measurement, and prints python literals of ``CONFIGS`` and ``TRITON_WINS`` to paste into
kernels/skinny_gemm.py (a win: Triton at least ``--win`` (2 %) faster than cuBLAS). About 2-3
minutes on an H200, most of it Triton compilation (SPLIT_K is a runtime argument, so a tile config
compiles once per M bucket and serves every shape).

    python benchmarks/skinny_gemm_bench.py [--shapes qkv,o,...] [--ms 1,8,16] [--iters 50] [--max-tiles 6]
                                           [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.kernels import skinny_gemm as sg  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

PEAK = hbm_bytes_per_s()     # the GPU's own peak HBM rate (devices.HBM_BYTES_PER_S; without a GPU the H200's 4.8e12)
SHAPES = {                       # name -> (N, K): weights [N, K] (Qwen3-8B; the draft's fc: 5 x hidden in)
    "kv": (1024, 4096),
    "o": (4096, 4096),
    "qkv": (6144, 4096),
    "down": (4096, 12288),
    "draft_fc": (4096, 20480),
    "gate_up": (24576, 4096),
    "lm_head": (151936, 4096),
}
MS = (1, 8, 16, 32, 64, 128)

# Tile candidates per M (BLOCK_N, BLOCK_K, num_warps, num_stages[, extra]); each is tried with two
# splits (the default rule's and the next one up, or 1 and 2), so <= 12 configs per shape.
FMA_TILES = [(32, 256, 4, 3), (16, 512, 4, 3), (64, 128, 4, 3), (32, 512, 8, 2), (64, 256, 8, 3), (16, 256, 2, 4)]
DOT_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4), (128, 64, 4, 4), (64, 64, 4, 6), (32, 256, 4, 4)]


def tiles_for(M: int) -> list[dict]:
    if M <= 4:
        return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, DOT=False) for n, k, w, s in FMA_TILES]
    out = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, DOT=True) for n, k, w, s in DOT_TILES[:5]]
    if M <= 8:
        out.append(dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3, DOT=False))   # CUDA-core, 8 rows
    elif M > 64:
        out.append(dict(BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3, DOT=True, BLOCK_M=128))
    else:
        n, k, w, s = DOT_TILES[5]
        out.append(dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, DOT=True))
    return out


def splits_for(M: int, N: int, K: int, tile: dict) -> list[int]:
    """The default rule's split for this tile (>= 2 programs per SM) and the next power of 2."""
    tiles = triton.cdiv(N, tile["BLOCK_N"]) * triton.cdiv(M, tile.get("BLOCK_M", 64))
    s = 1
    while tiles * s < 2 * sg.H200_SMS and K // (2 * s * tile["BLOCK_K"]) >= 2:
        s *= 2
    nxt = s * 2 if K // (s * 2 * tile["BLOCK_K"]) >= 2 else None
    return [s] + ([nxt] if nxt else [])


def graph_us(fns, iters: int) -> float:
    """Median microseconds per call of one CUDA-graph replay running every fn once."""
    for f in fns:                                    # compile / allocate outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    del g
    return ts[len(ts) // 2] * 1e3 / len(fns)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-tiles", type=int, default=6, help="tile candidates per M (x2 splits); 3 halves the time")
    ap.add_argument("--rotate-mb", type=float, default=256.0)
    ap.add_argument("--win", type=float, default=0.02, help="Triton must be this fraction faster to win")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    t_start = time.time()
    rows = []
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        wbytes = N * K * 2
        copies = max(1, math.ceil(args.rotate_mb * 2**20 / wbytes))
        ws = [(torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            nbytes = wbytes + M * K * 2 + M * N * 2
            ref = F.linear(x, ws[0])
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws], args.iters)
            row = {"shape": name, "N": N, "K": K, "M": M, "bucket": sg.m_bucket(M), "copies": copies,
                   "cublas_us": cublas, "cublas_pct": nbytes / (cublas * 1e-6) / PEAK * 100, "configs": []}
            for tile in tiles_for(M)[:args.max_tiles]:
                for split in splits_for(M, N, K, tile):
                    cfg = dict(tile, SPLIT_K=split)
                    rec = {"config": cfg}
                    try:
                        y = sg.skinny_gemm(x, ws[0], cfg)
                        err = (y.float() - ref.float()).abs().max().item()
                        rec["max_err"] = err
                        rec["ok"] = err <= 2e-2 + 1e-2 * ref.float().abs().max().item()
                        us = graph_us([lambda w=w: sg.skinny_gemm(x, w, cfg) for w in ws], args.iters)
                        rec.update(us=us, pct=nbytes / (us * 1e-6) / PEAK * 100)
                    except Exception as e:           # noqa: BLE001 - e.g. out of shared memory
                        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        traceback.print_exc(limit=1)
                    row["configs"].append(rec)
            good = [r for r in row["configs"] if r.get("ok") and "us" in r]
            best = min(good, key=lambda r: r["us"]) if good else None
            if best:
                row.update(best_config=best["config"], triton_us=best["us"], triton_pct=best["pct"],
                           speedup=cublas / best["us"])
                if best["config"]["SPLIT_K"] > 1:     # the two-launch reduction, for the record
                    cfg2 = dict(best["config"], REDUCE="two_pass")
                    try:
                        row["two_pass_us"] = graph_us([lambda w=w: sg.skinny_gemm(x, w, cfg2) for w in ws],
                                                      args.iters)
                    except Exception as e:           # noqa: BLE001
                        row["two_pass_error"] = str(e)[:300]
            bad = sum(1 for r in row["configs"] if not r.get("ok"))
            print(f"[{time.time() - t_start:6.1f}s] {name:8s} N={N:6d} K={K:5d} M={M:3d}  cuBLAS {cublas:8.2f} us "
                  f"({row['cublas_pct']:5.1f}%)  Triton " + (f"{best['us']:8.2f} us ({best['pct']:5.1f}%) "
                  f"x{cublas / best['us']:.2f} {best['config']}" if best else "none correct")
                  + (f"  [{bad} failed/incorrect]" if bad else ""), flush=True)
            rows.append(row)
        del ws
        torch.cuda.empty_cache()

    configs, wins = sg.tables_from_rows(rows, args.win)
    sha = provenance.git_sha()
    gpu = provenance.gpu_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"skinny-gemm-{gpu.replace(' ', '-')}-{sha}.json"
    configs_lit = "CONFIGS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(configs.items())) + "}"
    wins_lit = "TRITON_WINS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(wins.items())) + "}"
    doc = {"git_sha": sha, "gpu": gpu, "versions": provenance.versions(), "command": " ".join(sys.argv),
           "peak_bytes_per_s": PEAK, "shapes": {s: SHAPES[s] for s in args.shapes.split(",")}, "ms": ms,
           "iters": args.iters, "rotate_mb": args.rotate_mb, "win": args.win, "seconds": time.time() - t_start, "rows": rows,
           "configs_literal": configs_lit, "triton_wins_literal": wins_lit}
    path.write_text(json.dumps(doc, indent=1))
    print(f"\n{'shape':8s} {'M':>4s} {'cuBLAS %':>9s} {'Triton %':>9s} {'speedup':>8s}")
    for r in rows:
        if "triton_us" in r:
            print(f"{r['shape']:8s} {r['M']:4d} {r['cublas_pct']:9.1f} {r['triton_pct']:9.1f} {r['speedup']:8.2f}")
    print("\n# paste into dspark_trt/plugins/kernels/skinny_gemm.py")
    print(configs_lit)
    print(wins_lit)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
