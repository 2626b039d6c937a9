"""Does the one-token GEMV lose its bandwidth to unpipelined loads or to its grid's tail? (issue #21)

Triton software-pipelines only loads that feed ``tl.dot``: compiled for sm_90, the one-token body
of ``kernels/decode_gemv.py`` (a multiply-reduce on the CUDA cores) has no asynchronous copies, so
each program issues one ``[BLOCK_N, BLOCK_K]`` weight tile, waits for it, reduces it, and only then
issues the next; the bytes in flight come from the other resident programs alone. And a grid of
``cdiv(N, BLOCK_N)`` programs (768 for q/k/v at 8 rows) ends in a partial wave.

Timed here, bf16, one token, no prologue (the weights alone), per Qwen3-8B projection shape, as
median microseconds of CUDA-graph replays over weight copies rotated past L2:
- ``shipped``: ``decode_gemv`` with the GPU's one-token tile (``decode_rows.tile_for``);
- ``cublas``: ``F.linear``;
- ``stream``: the kernel below, one program per ``BLOCK_N`` rows (the shipped layout) with the next
  weight tile loaded into registers before the current one is reduced (``PREFETCH``);
- ``persist``: 2 or 4 programs per SM (``MODES``), each walking its row chunks (chunk c = pid +
  j * programs) as one flat loop over (chunk, K tile), prefetching across chunk ends, so no
  program waits at a chunk's start and the grid ends within one chunk of even.
Writes ``gemv-stream-probe-<gpu>-<sha>.json``.

    python benchmarks/gemv_stream_probe.py [--shapes qkv,o,gate_up,down,lm_head] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 4), (16, 512, 8), (16, 1024, 8))
MODES = (("stream", 0, True), ("persist", 2, True), ("persist", 4, True), ("persist", 4, False))


@triton.jit
def _tile_ptrs(w, i, pid, P, N, K, KT, rb, rk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight pointers of flat iteration i: chunk pid + (i // KT) * P, K tile i % KT."""
    rn = tl.minimum((pid + (i // KT) * P) * BLOCK_N + rb, N - 1).to(tl.int64)
    return w + rn[:, None] * K + ((i % KT) * BLOCK_K + rk)[None, :]


@triton.jit
def stream_gemv_kernel(x, w, y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """y [N] = w [N, K] @ x [K]; grid (P,): program pid owns chunks pid, pid + P, ... of BLOCK_N rows."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    KT = K // BLOCK_K
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, P) * KT        # this program's (chunk, K tile) steps
    rb = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    wt = tl.load(_tile_ptrs(w, 0, pid, P, N, K, KT, rb, rk, BLOCK_N, BLOCK_K))
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        nxt = tl.minimum(i + 1, total - 1)
        if PREFETCH:                                          # in flight while this tile is reduced
            wn = tl.load(_tile_ptrs(w, nxt, pid, P, N, K, KT, rb, rk, BLOCK_N, BLOCK_K))
        part += wt.to(tl.float32) * tl.load(x + (i % KT) * BLOCK_K + rk).to(tl.float32)[None, :]
        if i % KT == KT - 1:                                  # the chunk's last K tile: store its rows
            offs = (pid + (i // KT) * P) * BLOCK_N + rb
            tl.store(y + offs, tl.sum(part, 1).to(y.dtype.element_ty), mask=offs < N)
            part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:
            wt = wn
        else:
            wt = tl.load(_tile_ptrs(w, nxt, pid, P, N, K, KT, rb, rk, BLOCK_N, BLOCK_K))


def stream_gemv(x, w, y, bn: int, bk: int, warps: int, programs: int, prefetch: bool):
    stream_gemv_kernel[(programs,)](x, w, y, w.shape[0], w.shape[1], BLOCK_N=bn, BLOCK_K=bk, PREFETCH=prefetch,
                                    num_warps=warps, num_stages=1)
    return y


def probe_shape(name: str, rotate_mb: float, iters: int) -> dict:
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    from dspark_trt.plugins.kernels.decode_rows import tile_for
    N, K = SHAPES[name]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copies = max(2, int(rotate_mb * 2**20 / (2 * N * K)) + 1)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(K, generator=g, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, generator=g, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    y = torch.empty(N, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    scale = ref.abs().max().item()
    roof = 2 * N * K / hbm_bytes_per_s() * 1e6
    shipped = tile_for(1, N, K, dev)
    row = dict(shape=name, N=N, K=K, copies=copies, roofline_us=roof, shipped_tile=shipped,
               cublas_us=graph_us([lambda w=w: F.linear(x, w) for w in ws], iters),
               shipped_us=graph_us([lambda w=w: decode_gemv(x, w, out=y, config=shipped) for w in ws], iters))
    timed = []
    for bn, bk, warps in TILES:
        if K % bk:
            continue
        for mode, per_sm, prefetch in MODES:
            programs = triton.cdiv(N, bn) if mode == "stream" else per_sm * sms
            cfg = dict(mode=mode, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, programs=programs, prefetch=prefetch)
            try:
                err = (stream_gemv(x, ws[0], y, bn, bk, warps, programs, prefetch).float() - ref).abs().max().item()
                if not err <= 0.02 * scale:
                    raise AssertionError(f"max error {err:.4g} of scale {scale:.4g}")
                us = graph_us([lambda w=w: stream_gemv(x, w, y, bn, bk, warps, programs, prefetch) for w in ws], iters)
                timed.append(dict(cfg, us=us, pct=roof / us * 100))
            except Exception as e:                            # noqa: BLE001 - reported per tile
                timed.append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:160]}"))
    ok = [t for t in timed if "us" in t]
    best = {m: min((t for t in ok if t["mode"] == m), key=lambda t: t["us"], default=None) for m in ("stream", "persist")}
    row.update(variants=timed, best=best, shipped_pct=roof / row["shipped_us"] * 100, cublas_pct=roof / row["cublas_us"] * 100)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rotate-mb", type=float, default=256.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_stream_probe: needs a CUDA GPU")
    t0 = time.time()
    rows = []
    for name in args.shapes.split(","):
        r = probe_shape(name, args.rotate_mb, args.iters)
        rows.append(r)
        line = " ".join(f"{m} {b['us']:.1f} us ({b['pct']:.0f} %, {b['BLOCK_N']}x{b['BLOCK_K']} w{b['num_warps']} "
                        f"p{b['programs']}{'' if b['prefetch'] else ' nopf'})" for m, b in r["best"].items() if b)
        print(f"[stream] {name}: roofline {r['roofline_us']:.1f} | shipped {r['shipped_us']:.1f} us "
              f"({r['shipped_pct']:.0f} %) | cublas {r['cublas_us']:.1f} | {line}", flush=True)
    gpu = provenance.gpu_name()
    out = provenance.result_path(args.out, "gemv-stream-probe", gpu)
    out.write_text(json.dumps(dict(git_sha=provenance.git_sha(), gpu=gpu, versions=provenance.versions(),
                                   command=" ".join(sys.argv), hbm_bytes_per_s=hbm_bytes_per_s(),
                                   seconds=time.time() - t0, rows=rows), indent=1))
    print(f"[stream] wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
