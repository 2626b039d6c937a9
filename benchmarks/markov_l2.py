"""Exact Markov sampler with part of W2 resident in L2 (persisting access-policy window), H200.

For each shape and launch config, the sampler is captured into a CUDA graph (cuda-python capture,
as the runtime does) from a stream whose access-policy window covers W2 with ``resident`` MB
persisting (``benchmarks/l2_residency.py``), and timed warm (replayed back to back) and cold
(after a 256 MB write that flushes every normal L2 line, as a target step between two draft steps
would). Tokens and z are checked against the PyTorch reference. References in the same run, no
window: N ``torch.mv`` over W2 (cuBLAS GEMV, the same bytes without the sampling), N plain reads of
W2 (``torch.sum``), and the asymptotic read rate of the device (``torch.sum`` over 4 GiB).
``bw_frac`` = (W2 once per step + U read + z written) / cold time / 4.8 TB/s, as benchmarks/plugins.py.

    python benchmarks/markov_l2.py [--out DIR]
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
import triton  # noqa: E402

from benchmarks.plugins import PEAK, err, markov_bytes, markov_inputs, replay_seconds  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.kernels import markov_launch as kmk  # noqa: E402
from dspark_trt.plugins.markov_sample import markov_sample_ref  # noqa: E402
from benchmarks import l2_residency as l2  # noqa: E402
from dspark_trt.runtime.cuda_graphs import CapturedGraph  # noqa: E402

N = 7
MB = 1 << 20
# {} = the batch-1 default (kernels/markov_launch.py MARKOV_B1); a config naming one_launch or gemv is
# taken whole (MARKOV_DEFAULTS + MARKOV_SMALL_B + it). One-launch grids are cut to what fits.
B1_CONFIGS = [{}, {"packed": False}, {"pipeline": False},
              {"one_launch": False, "reduce": "prologue", "snake": True}]
CASES = [  # (B, V, r, configs, resident MB; None = the device's largest set-aside, steps, temperature;
    #          None = rows alternate greedy / 0.8 starting greedy, as benchmarks/plugins.py)
    (1, 151936, 256, B1_CONFIGS, [0, None], N, None),
    (1, 151936, 256, [{}, {"packed": False}], [0, None], N, 0.8),   # batch 1 sampled
    (1, 151936, 256, [{}, {"packed": False}], [0], 1, None),       # the fixed cost of a call
    (1, 129280, 512, [{}, {"pipeline": True}], [0, None], N, None),
    *[(B, 151936, 256, [{}, {"one_launch": True}], [0], N, None) for B in (8, 16, 32)],
    (64, 151936, 256, [{}, {"one_launch": True}, {"one_launch": True, "packed": False}], [0], N, None),
]


def graph_times(fn, stream, pool, flush, reps=30) -> tuple[float, float, list[int]]:
    """(warm, cold) seconds per call of ``fn`` captured from ``stream``; windows of its kernel nodes."""
    graphs = [CapturedGraph(body, pool, "cuda-python", stream=stream)
              for body in (fn, lambda: (flush.zero_(), fn()), flush.zero_)]
    windows = l2.graph_windows(graphs[0]._graph)

    warm, both, flush_only = (replay_seconds(g.launch, reps) for g in graphs)
    return warm, max(both - flush_only, 1e-9), windows


def run_case(B, V, r, configs, residents, steps, temperature, info, flush, pool) -> list[dict]:
    args = markov_inputs(B, steps, V, r)
    if temperature is not None:
        args = (*args[:4], torch.full_like(args[4], temperature), *args[5:])
    w2 = args[3]
    rt, rz = markov_sample_ref(*args)
    nbytes = markov_bytes(B, steps, V, r)
    shape = f"B={B} N={steps} V={V} r={r}" + ("" if temperature is None else f" T={temperature}")
    rows = []
    for cfg in configs:
        for mb in residents:
            want = info["max_persisting_bytes"] if mb is None else mb * MB
            stream = torch.cuda.Stream()
            window = l2.set_window(stream, w2, want)
            out = {}
            fits = dict(kmk._FIT_CACHE)
            fn = lambda: out.__setitem__("r", kmk.markov_sample_triton(*args, **cfg))   # noqa: E731
            try:
                warm, cold, windows = graph_times(fn, stream, pool, flush)
                tokens, z = out["r"]
                row = dict(ok=bool(torch.equal(tokens, rt)), z_max_err=err(z, rz), graph_us=warm * 1e6,
                           graph_cold_us=cold * 1e6, bw_frac=nbytes / cold / PEAK,
                           kernel_nodes_with_window=sum(w > 0 for w in windows), kernel_nodes=len(windows),
                           fit_per_sm=[v for k, v in kmk._FIT_CACHE.items() if k not in fits])
            except Exception as e:                              # record it, go on
                row = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            l2.clear_window(stream)
            rows.append(dict(shape=shape, config=cfg, resident_mb=window.resident_bytes / MB,
                             hit_ratio=window.hit_ratio, bytes=nbytes, **row))
            print(json.dumps(rows[-1]), flush=True)
    # references, no window: cuBLAS GEMV over the same W2 and a plain read of it (torch.sum), N times
    h = torch.randn(r, device="cuda", dtype=w2.dtype)
    w2_bytes = steps * w2.numel() * w2.element_size()
    for name, ref in (("torch.mv x N (reference)", lambda: [torch.mv(w2, h) for _ in range(steps)]),
                      ("torch.sum(W2) x N (read only)", lambda: [w2.sum(dtype=torch.float32) for _ in range(steps)])):
        warm, cold, _ = graph_times(ref, torch.cuda.Stream(), pool, flush)
        rows.append(dict(shape=shape, config=name, resident_mb=0, bytes=w2_bytes, graph_us=warm * 1e6,
                         graph_cold_us=cold * 1e6, bw_frac=w2_bytes / cold / PEAK))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    info = l2.l2_info(0)
    print(json.dumps(info), flush=True)
    flush = torch.empty(256 * MB, dtype=torch.uint8, device="cuda")
    pool = torch.cuda.MemPool()
    rows = []
    gpu, sha = torch.cuda.get_device_name(), provenance.git_sha()
    path = Path(a.out) / f"markov-l2-{gpu.replace(' ', '_')}-{sha}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    big = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")       # 4 GiB: the asymptotic read rate
    read_s = replay_seconds(lambda: big.sum(dtype=torch.float32), 5)
    rows.append(dict(shape="4 GiB bf16", config="torch.sum (read only, asymptotic)", bytes=big.numel() * 2,
                     graph_us=read_s * 1e6, bw_frac=big.numel() * 2 / read_s / PEAK))
    print(json.dumps(rows[-1]), flush=True)
    del big
    for B, V, r, configs, residents, steps, temperature in CASES:       # written after each shape
        rows += run_case(B, V, r, configs, residents, steps, temperature, info, flush, pool)
        doc = dict(git_sha=sha, gpu=gpu, torch=torch.__version__, triton=triton.__version__, l2=info,
                   peak_bytes_per_s=PEAK, command=" ".join([sys.executable] + sys.argv),
                   seconds=round(time.perf_counter() - t0, 1), rows=rows)
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
