"""Tile sweep of the few-token decode GEMV (``kernels/decode_rows.py``, issue #21) on a GPU.

Per Qwen3-8B projection, with the prologue the token step gives it (q/k/v and gate/up: RMSNorm of
the residual sum, written back; o: none; down: SwiGLU; the head: the final norm), and per token
count M (2, 4, 8: a verify block of N = 7 drafts; 16; 1 with ``--rows 1``: the one-token kernel's
tiles against the rows kernel's, ``ROWS``), every candidate tile (tensor-core / CUDA-core
body, BLOCK_N x BLOCK_K, split-K, warps, stages) against
- ``cublas``: ``F.linear`` of the prologue's output (the GEMM alone),
- ``modules``: the torch prologue (``RMSNorm`` of ``x + residual`` / ``silu(gate) * up``) + ``F.linear``,
as median microseconds of CUDA-graph replays over weight copies rotated past L2, and the fraction
of the HBM roofline (weight bytes / 4.8 TB/s). Writes ``decode-rows-<gpu>-<sha>.json``, whose
winners ``decode_rows.load_table`` reads (``DSPARK_DECODE_ROWS_TABLE=<file>``).

``--fp8`` (issue #23): the weights quantised to fp8 e4m3 with 128x128 block scales (``quantize_fp8``,
the Qwen3-FP8 layout; ``decode_gemv(w_scale=...)``), the roofline on their bytes (one per weight and
the scales), the reference their dequantised fp32 product; ``cublas`` / ``modules`` stay the bf16
weights' (twice the bytes). Rows carry ``weight_bytes: 1``.

Hundreds of tiles take longer to compile than to time: ``--jobs`` processes compile them first
(Triton's disk cache), then this process times them.

    python benchmarks/decode_rows_sweep.py [--rows 2,4,8,16] [--shapes qkv,o,gate_up,down,lm_head] [--jobs 14]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402
from dspark_trt import provenance  # noqa: E402

HBM = 4.8e12
FP8 = False                 # --fp8: the weights in fp8 e4m3 with block scales (compile workers: via compile_cases)
SHAPES = {"qkv": (6144, 4096, "rmsnorm"), "o": (4096, 4096, "none"), "gate_up": (24576, 4096, "rmsnorm"),
          "down": (4096, 12288, "swiglu"), "lm_head": (151936, 4096, "rmsnorm"),
          "draft_head_32k": (32768, 4096, "rmsnorm")}   # a draft vocabulary's head (models/draft_vocab.py)
DEFAULT_SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
# Tensor-core tiles of BLOCK_K 256 (but 64 x 256) and 512 and CUDA-core tiles at 8 tokens lost to these by
# 1.2-5x on the H200 at Qwen3-8B shapes (decode-rows-NVIDIA-H200-61d9ae4.json.gz) and are not swept.
DOT_TILES = ((64, 64), (64, 128), (128, 64), (128, 128), (32, 128), (64, 256))
CUDA_CORE_TILES = ((16, 256), (32, 128), (32, 256), (16, 512), (8, 1024))
LAUNCHES = ((4, 3), (4, 4), (8, 4), (4, 2), (8, 3))           # (num_warps, num_stages) of tensor-core tiles


FOCUS_TILES = ((8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))
ONE_TOKEN_TILES = ((4, 512), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (4, 1024), (16, 1024),
                   (32, 256), (32, 512))


def candidates(M: int, N: int, K: int, sms: int = 132, stages=(), focus: bool = False) -> list[dict]:
    """Tiles worth timing, first the one taken without a sweep: the rows kernel's ``default_config``
    and ``rows_tiles``; at M = 1 ``decode_gemv_kernel``'s tile today (``config_for``), its variants,
    then the rows kernel's tiles marked ``ROWS`` (split K, the deferred norm scale), and every CUDA-core
    tile of both also with ``PREFETCH`` (the next weight tile loaded before the current one is reduced
    in registers) and with each ``K_STAGES`` of ``stages`` (the weight loop pipelined through shared
    memory by Triton, which it does for loads that feed no ``tl.dot`` only where the loop asks).
    ``focus`` (M = 1): the tile the GPU runs today (its shipped table, ``decode_rows.tile_for``, else
    ``config_for``) and ``FOCUS_TILES``, each as is and with ``stages``."""
    if M == 1:
        from dspark_trt.plugins.kernels.decode_gemv import config_for
        if focus:
            from dspark_trt.plugins.kernels.decode_rows import tile_for
            one = [tile_for(1, N, K, torch.device("cuda")) or config_for(N, K)]
            one += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3) for bn, bk in FOCUS_TILES if K % bk == 0]
        else:
            one = [config_for(N, K)] + [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3)
                                        for bn, bk in ONE_TOKEN_TILES if K % bk == 0 for nw in (4, 8)]
            one += [dict(c, ROWS=True) for c in rows_tiles(1, N, K, sms)]
            one += [dict(c, PREFETCH=True) for c in one if not c.get("DOT")]
        staged = [dict(c, K_STAGES=st, PREFETCH=False) for c in one if not c.get("DOT") for st in stages]
        return _unique(one + staged)
    from dspark_trt.plugins.kernels.decode_rows import default_config
    return _unique([default_config(M, N, K, sms)] + rows_tiles(M, N, K, sms))


def rows_tiles(M: int, N: int, K: int, sms: int = 132) -> list[dict]:
    """The rows kernel's tiles: per (body, BLOCK_N, BLOCK_K) the one to three splits of K that give
    1-12 programs per SM (K tiles >= 2 per split), a few warp / stage counts."""
    bodies = [(True, DOT_TILES, LAUNCHES)]
    if M <= 4:
        bodies.append((False, CUDA_CORE_TILES, ((4, 3),)))
    if N > 100_000:                                           # the head: wide tiles only, no split
        bodies = [(True, ((128, 128), (128, 64), (64, 128)), ((4, 4), (8, 4)))]
    out = []
    for dot, tiles, launches in bodies:
        for bn, bk in tiles:
            splits = [s for s in (1, 2, 4, 8, 16) if K % (s * bk) == 0 and K // (s * bk) >= 2
                      and -(-N // bn) * s <= 12 * sms]
            fill = [s for s in splits if -(-N // bn) * s >= sms] or splits[-1:]
            for split in fill[:3]:
                for nw, ns in launches:
                    out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, DOT=dot, num_warps=nw, num_stages=ns))
    return out


def _unique(configs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in configs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def inputs(M: int, N: int, K: int, prologue: str, copies: int = 1, seed: int = 0):
    """x, residual, norm weight, residual_out and ``copies`` bf16 weight copies of one case (under
    ``FP8``: (fp8 codes, block scales) pairs of them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, 2 * K if prologue == "swiglu" else K, generator=g, **dev)
    res = torch.randn(M, K, generator=g, **dev) if prologue != "swiglu" and prologue != "none" else None
    norm = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16() if prologue == "rmsnorm" else None
    r_out = torch.empty(M, K, **dev) if res is not None else None
    ws = [torch.randn(N, K, generator=g, **dev) * 0.02 for _ in range(copies)]
    if FP8:
        from dspark_trt.plugins.fp8_linear import quantize_fp8
        ws = [quantize_fp8(w) for w in ws]
    return x, res, norm, r_out, ws


def run_tile(x, w, prologue, res, norm, r_out, cfg):
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    w, scale = w if isinstance(w, tuple) else (w, None)
    return decode_gemv(x, w, prologue, residual=res, norm_weight=norm, residual_out=r_out, config=cfg, w_scale=scale)


def dense(w):
    """A case's weight as the bf16 / fp32 tensor cuBLAS and the reference multiply (fp8: dequantised)."""
    from dspark_trt.plugins.fp8_linear import dequantize_fp8
    return dequantize_fp8(*w, torch.bfloat16) if isinstance(w, tuple) else w


def compile_cases(cases: list[tuple], fp8: bool = False) -> list[str]:
    """A worker: launch each (shape, M, config) once (Triton compiles it into its disk cache)."""
    global FP8
    FP8, errors = fp8, []
    for name, M, cfg in cases:
        N, K, prologue = SHAPES[name]
        try:
            x, res, norm, r_out, ws = inputs(M, N, K, prologue)
            run_tile(x, ws[0], prologue, res, norm, r_out, cfg)
            torch.cuda.synchronize()
        except Exception as e:                                # noqa: BLE001 - reported, timed later
            errors.append(f"{name} M={M} {cfg}: {type(e).__name__}: {str(e)[:160]}")
    return errors


def module_prologue(prologue: str, x, res, norm):
    """The modules' way, as a function of (x, residual) (the RMSNorm module made here, outside
    any graph capture)."""
    from dspark_trt.models.layers import RMSNorm
    if prologue == "swiglu":
        K = x.shape[-1] // 2
        return lambda: F.silu(x[..., :K]) * x[..., K:]
    if prologue == "rmsnorm":
        rms = RMSNorm(x.shape[-1], 1e-6).to(device=x.device, dtype=x.dtype)
        rms.weight.data = norm
        return lambda: rms(x if res is None else x + res)
    return lambda: x if res is None else x + res


def sweep_case(name: str, M: int, rotate_mb: float, iters: int, stages=(), focus: bool = False) -> dict:
    N, K, prologue = SHAPES[name]
    weight_bytes = 1 if FP8 else 2
    past_l2 = lambda nbytes: max(2, int(rotate_mb * 2**20 / (nbytes * N * K)) + 1)   # noqa: E731  copies
    copies = past_l2(weight_bytes)
    x, res, norm, r_out, ws = inputs(M, N, K, prologue, copies)
    prologue_fn = module_prologue(prologue, x, res, norm)
    xin = prologue_fn()
    wide = [dense(w) for w in ws[:past_l2(2)]] if FP8 else ws   # cuBLAS / modules: bf16 weights, past L2 too
    ref = F.linear(xin.float(), dense(ws[0]).float() if FP8 else ws[0].float())
    scale = ref.abs().max().item()
    scale_bytes = 4 * -(-N // 128) * -(-K // 128) if FP8 else 0
    byte_us = (weight_bytes * N * K + scale_bytes) / HBM * 1e6      # the weights at the HBM limit, us
    row = dict(shape=name, N=N, K=K, M=M, bucket=_bucket(M), prologue=prologue, copies=copies,
               roofline_us=byte_us, weight_bytes=weight_bytes,
               cublas_us=graph_us([lambda w=w: F.linear(xin, w) for w in wide], iters),
               modules_us=graph_us([lambda w=w: F.linear(prologue_fn(), w) for w in wide], iters))
    timed = []
    for cfg in candidates(M, N, K, stages=stages, focus=focus):
        try:
            err = (run_tile(x, ws[0], prologue, res, norm, r_out, cfg).float() - ref).abs().max().item()
            if not err <= 0.02 * scale:
                raise AssertionError(f"max error {err:.4g} of scale {scale:.4g}")
            us = graph_us([lambda w=w: run_tile(x, w, prologue, res, norm, r_out, cfg) for w in ws], iters)
            timed.append(dict(config=cfg, us=us, pct=byte_us / us * 100))
        except Exception as e:                                # noqa: BLE001 - e.g. out of shared memory
            timed.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:160]}"))
    ok = [t for t in timed if "us" in t]
    best = min(ok, key=lambda t: t["us"]) if ok else None
    row.update(configs=timed, default_us=timed[0].get("us"), best_config=best and best["config"],
               best_us=best and best["us"], best_pct=best and best["pct"],
               cublas_pct=byte_us / row["cublas_us"] * 100, modules_pct=byte_us / row["modules_us"] * 100)
    return row


def _bucket(M: int) -> int:
    from dspark_trt.plugins.kernels.decode_rows import m_bucket
    return m_bucket(M)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--jobs", type=int, default=14, help="compiling processes (0: compile while timing)")
    ap.add_argument("--rotate-mb", type=float, default=400.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--stages", default="", help="K_STAGES values every CUDA-core tile is also timed with, e.g. 2,3,4")
    ap.add_argument("--focus", action="store_true", help="M = 1: the tile the GPU runs today and FOCUS_TILES only")
    ap.add_argument("--fp8", action="store_true", help="fp8 e4m3 weights with 128x128 block scales (module doc)")
    args = ap.parse_args()
    global FP8
    FP8 = args.fp8
    pick = dict(stages=[int(v) for v in args.stages.split(",") if v], focus=args.focus)
    global HBM
    HBM = hbm_bytes_per_s()                    # the GPU's own (4.8 TB/s: the H200's)
    t0 = time.time()
    rows_list = [int(m) for m in args.rows.split(",")]
    shapes = args.shapes.split(",")
    cases = [(s, M, c) for s in shapes for M in rows_list for c in candidates(M, *SHAPES[s][:2], **pick)]
    print(f"[rows] {len(cases)} tiles to compile with {args.jobs} processes", flush=True)
    if args.jobs:
        chunks = [cases[i::args.jobs] for i in range(args.jobs)]
        with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for errs in pool.map(functools.partial(compile_cases, fp8=FP8), chunks):
                for e in errs[:3]:
                    print(f"[rows] compile: {e}", flush=True)
    print(f"[rows] compiled in {time.time() - t0:.0f} s", flush=True)
    gpu, sha = torch.cuda.get_device_name(), provenance.git_sha()
    out = Path(args.out) / f"decode-rows-{'fp8-' if FP8 else ''}{gpu.replace(' ', '-')}-{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in shapes:
        for M in rows_list:
            try:
                r = sweep_case(s, M, args.rotate_mb, args.iters, **pick)
                rows.append(r)
                print(f"[rows] {s:8s} M={M:2d} best {r['best_us']:.1f} us ({r['best_pct']:.0f} %) default "
                      f"{r['default_us'] or float('nan'):.1f} cublas {r['cublas_us']:.1f} ({r['cublas_pct']:.0f} %) "
                      f"modules {r['modules_us']:.1f} ({r['modules_pct']:.0f} %) {r['best_config']}", flush=True)
            except Exception as e:                            # noqa: BLE001 - the other cases still run
                print(f"[rows] {s} M={M}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            doc = dict(git_sha=sha, gpu=gpu, versions=provenance.versions(),
                       command="python benchmarks/decode_rows_sweep.py " + " ".join(sys.argv[1:]),
                       peak_bytes_per_s=HBM, rows=rows, seconds=time.time() - t0)
            out.write_text(json.dumps(doc, indent=1))            # after every case: a cut run keeps its rows
    print(f"[rows] wrote {out} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
