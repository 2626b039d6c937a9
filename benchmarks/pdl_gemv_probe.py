"""Can programmatic dependent launch (PDL) lift a chain of decode GEMVs towards the HBM limit?
(issue #21: the AR step's projections run at 56-86 % of HBM one by one; the step needs ~90 %.)

A GEMV of a few us loses its ramp-up and tail to the gap between kernels: the next kernel's
programs start only when the last program of the previous one ends. With PDL (sm_90: the launch
attribute ``programmaticStreamSerialization``, Triton's ``launch_pdl=True`` and
``gdc_launch_dependents`` / ``gdc_wait``) the next GEMV launches while the previous one drains and
loads its first ``PRE_K`` weight columns before it waits for its input (weights never depend on
the previous kernel).

Measured here, bf16, M = 1, Qwen3-8B layer shapes (fused q/k/v, o, fused gate/up, down) x 36
layers of distinct weights (13.9 GB, far over L2), each chain one CUDA graph, median of replays:
- ``cublas``: ``F.linear`` chain;
- ``triton``: this file's GEMV kernel, best config per shape (swept alone, over weight copies), no PDL;
- ``triton_pdl``: the same configs launched with PDL (``PRE_K`` columns before the wait);
- ``*_interleaved``: a small non-PDL elementwise kernel after every GEMV (the norms, RoPE and
  residual adds of a real layer), to see what PDL keeps when its neighbours are not PDL kernels.
Roofline: the chain's weight bytes / 4.8 TB/s. Writes ``pdl-gemv-probe-<gpu>-<sha>.json``.

    python benchmarks/pdl_gemv_probe.py [--layers 36] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
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

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                                   # older Triton: no GDC
    gdc_launch_dependents = gdc_wait = None

PEAK = 4.8e12
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
         for bn, bk, nw, ns in itertools.product((8, 16, 32), (256, 512), (4, 8), (3,))]


@triton.jit
def gemv_kernel(x, w, y, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                PDL: tl.constexpr):
    """y[N] = w[N, K] @ x[K] (N a multiple of BLOCK_N, K - PRE_K of BLOCK_K)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
    rp = tl.arange(0, PRE_K)
    w0 = tl.load(w + rn[:, None] * stride_wn + rp[None, :])          # [BLOCK_N, PRE_K]: no dependency
    if PDL:
        gdc_wait()                                                   # x is the previous kernel's output
    acc = tl.sum(w0.to(tl.float32) * tl.load(x + rp).to(tl.float32)[None, :], 1)
    rk = tl.arange(0, BLOCK_K)
    part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(PRE_K, K, BLOCK_K):
        wt = tl.load(w + rn[:, None] * stride_wn + (k + rk)[None, :])
        part += wt.to(tl.float32) * tl.load(x + k + rk).to(tl.float32)[None, :]
    acc += tl.sum(part, 1)
    tl.store(y + rn, acc.to(y.dtype.element_ty))


def gemv(x, w, y, cfg, pdl: bool, pre_k: int | None = None):
    N, K = w.shape
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    pre = pre_k or bk
    kw = {"launch_pdl": True} if pdl else {}
    gemv_kernel[(N // bn,)](x, w, y, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, PRE_K=pre, PDL=pdl,
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **kw)
    return y


def best_config(N: int, K: int, rotate_mb: float, iters: int) -> tuple[dict, float, float, list]:
    dev = torch.device("cuda")
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
          for _ in range(max(2, int(rotate_mb * 2**20 / (2 * N * K)) + 1))]
    x = torch.randn(K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(N, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x[None], ws[0])[0].float()
    cublas = graph_us([lambda w=w: F.linear(x[None], w) for w in ws], iters)
    timed = []
    for cfg in SWEEP:
        try:
            err = (gemv(x, ws[0], y, cfg, False).float() - ref).abs().max().item()
            if err > 1e-2 * ref.abs().max().item() + 1e-2:
                raise AssertionError(f"max err {err}")
            timed.append((graph_us([lambda w=w: gemv(x, w, y, cfg, False) for w in ws], iters), cfg))
        except Exception as e:                             # noqa: BLE001 - e.g. out of registers
            print(f"[pdl] {N}x{K} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    us, cfg = min(timed, key=lambda t: t[0])
    return cfg, us, cublas, [{"config": c, "us": u} for u, c in timed]


def chain_ms(layers, x0, cfgs, mode: str, iters: int, pre_mult: int = 1) -> float:
    """One CUDA graph of every layer's four GEMVs (q/k/v's first K entries feed o, and so on)."""
    pdl = mode.startswith("triton_pdl")
    inter = mode.endswith("interleaved")

    def run():
        h = x0
        for lw, ys in layers:
            for (name, w), y in zip(lw, ys):
                xin = h[: w.shape[1]]                  # every output is at least the next input's K
                if mode.startswith("cublas"):
                    torch.matmul(w, xin, out=y)
                else:
                    gemv(xin, w, y, cfgs[name], pdl, cfgs[name]["BLOCK_K"] * pre_mult)
                if inter:
                    y.mul_(1.0)
                h = y
        return h

    return graph_us([run], iters) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rotate-mb", type=float, default=300.0)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if gdc_wait is None:
        sys.exit("[pdl] this Triton has no triton.language.extra.cuda.gdc_wait")
    t0 = time.time()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    per_shape, cfgs = {}, {}
    for name, (N, K) in SHAPES.items():
        cfg, us, cublas, sweep = best_config(N, K, args.rotate_mb, 30)
        cfgs[name] = cfg
        per_shape[name] = {"N": N, "K": K, "best": cfg, "triton_us": us, "cublas_us": cublas,
                           "triton_pct": 2 * N * K / (us * 1e-6) / PEAK * 100,
                           "cublas_pct": 2 * N * K / (cublas * 1e-6) / PEAK * 100, "sweep": sweep}
        print(f"[pdl {time.time() - t0:5.1f}s] {name:8s} alone: triton {us:6.2f} us "
              f"({per_shape[name]['triton_pct']:.1f} %), cuBLAS {cublas:6.2f} us "
              f"({per_shape[name]['cublas_pct']:.1f} %) {cfg}", flush=True)
    layers = [([(n, torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02) for n, (N, K) in SHAPES.items()],
               [torch.empty(N, device=dev, dtype=torch.bfloat16) for N, _ in SHAPES.values()])
              for _ in range(args.layers)]
    x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    wbytes = sum(2 * N * K for N, K in SHAPES.values()) * args.layers
    roof_ms = wbytes / PEAK * 1e3
    # the PDL chain computes the same values as the plain one
    ref = None
    chains = {}
    for mode, pre in (("cublas", 1), ("triton", 1), ("triton_pdl", 1), ("triton_pdl_pre2", 2),
                      ("cublas_interleaved", 1), ("triton_interleaved", 1), ("triton_pdl_interleaved", 1)):
        try:
            ms = chain_ms(layers, x0, cfgs, mode, args.iters, pre)
            chains[mode] = {"ms": ms, "pct_roofline": roof_ms / ms * 100, "pre_k_blocks": pre}
            print(f"[pdl {time.time() - t0:5.1f}s] chain {mode:24s} {ms:7.3f} ms  {roof_ms / ms * 100:5.1f} % "
                  f"of the {roof_ms:.3f} ms roofline", flush=True)
        except Exception as e:                             # noqa: BLE001
            chains[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"[pdl] chain {mode}: {chains[mode]['error']}", flush=True)
    last = layers[-1][1][-1]
    for mode in ("triton", "triton_pdl"):
        chain_ms(layers, x0, cfgs, mode, 1)
        out = last.float().clone()
        ref = out if ref is None else ref
        chains.setdefault(mode, {})["equal_to_triton"] = bool(torch.equal(out, ref))
    print(f"[pdl] PDL chain output equals the plain Triton chain: {chains['triton_pdl'].get('equal_to_triton')}")
    sha = provenance.git_sha()
    rec = {"git_sha": sha, "gpu": provenance.gpu_name(), "versions": provenance.versions(),
           "command": " ".join(sys.argv), "layers": args.layers, "weight_bytes": wbytes, "roofline_ms": roof_ms,
           "peak_bytes_per_s": PEAK, "shapes": per_shape, "chains": chains, "seconds": time.time() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pdl-gemv-probe-{provenance.gpu_name().replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps(rec, indent=1))
    print("[pdl] wrote", path)


if __name__ == "__main__":
    main()
