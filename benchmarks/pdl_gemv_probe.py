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
- ``triton``: ``kernels/decode_gemv.py`` without a prologue (at e057240 the same body inline in this
  file), best config per shape (swept alone, over weight copies), no PDL;
- ``triton_pdl``: the same configs launched with PDL (``PRE_K`` columns before the wait);
- ``*_interleaved``: a small non-PDL elementwise kernel after every GEMV (the norms, RoPE and
  residual adds of a real layer), to see what PDL keeps when its neighbours are not PDL kernels;
- ``layer_*``: the layer's GEMVs with its elementwise work (residual adds, both RMSNorms, SwiGLU;
  the attention left out): cuBLAS + torch ops as an eager layer runs them, against
  ``kernels/decode_gemv.py`` with that work in its prologues, with and without PDL.
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

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.models.layers import RMSNorm  # noqa: E402
from dspark_trt.plugins.kernels import decode_gemv as dg  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

PEAK = hbm_bytes_per_s()     # the GPU's own peak HBM rate (devices.HBM_BYTES_PER_S; without a GPU the H200's 4.8e12)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
         for bn, bk, nw, ns in itertools.product((8, 16, 32), (256, 512), (4, 8), (3,))]


def gemv(x, w, y, cfg, pdl: bool, pre_k: int | None = None, **prologue):
    """``decode_gemv`` into y with the given tile."""
    return dg.decode_gemv(x, w, out=y, config=cfg, pdl=pdl, pre_k=pre_k, **prologue)


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


def layer_chain_ms(layers, norms, x0, cfgs, mode: str, iters: int) -> tuple[float, torch.Tensor]:
    """One CUDA graph of every layer's GEMVs with the layer's elementwise work (the attention left
    out: q/k/v's first hidden-size values feed o): the residual adds, both RMSNorms and SwiGLU.
    ``layer_cublas_torch``: cuBLAS and torch ops, as an eager layer runs them; ``layer_fused`` /
    ``layer_fused_pdl``: four ``decode_gemv`` launches, the norms, residual adds and SwiGLU in their
    prologues. -> (ms, the residual stream after the last layer)."""
    fused, pdl = mode.startswith("layer_fused"), mode.endswith("pdl")
    h_in = x0.clone()
    out = torch.empty_like(x0)

    def run():
        h, pending = h_in, torch.zeros_like(x0)
        for (lw, ys), (n1, n2, ha, hb) in zip(layers, norms):
            (_, wq), (_, wo), (_, wgu), (_, wd) = lw
            if fused:
                qkv = gemv(h, wq, ys[0], cfgs["qkv"], pdl, prologue="rmsnorm", residual=pending,
                           norm_weight=n1.weight, residual_out=ha)
                o = gemv(qkv[:wo.shape[1]], wo, ys[1], cfgs["o"], pdl)
                gu = gemv(o, wgu, ys[2], cfgs["gate_up"], pdl, prologue="rmsnorm", residual=ha,
                          norm_weight=n2.weight, residual_out=hb)
                pending = gemv(gu, wd, ys[3], cfgs["down"], pdl, prologue="swiglu")
                h = hb
            else:
                h = h + pending
                o = F.linear(F.linear(n1(h), wq)[:wo.shape[1]], wo)
                h = h + o
                gate, up = F.linear(n2(h), wgu).chunk(2)
                pending = F.linear(F.silu(gate) * up, wd)
        out.copy_(h + pending)

    return graph_us([run], iters) / 1e3, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rotate-mb", type=float, default=300.0)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if dg.gdc_wait is None:
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
    norms = []
    for _ in range(args.layers):
        n1, n2 = RMSNorm(4096).to(dev, torch.bfloat16), RMSNorm(4096).to(dev, torch.bfloat16)
        for n in (n1, n2):
            n.weight.data = (1 + 0.1 * torch.randn(4096, device=dev)).bfloat16()
        norms.append((n1, n2, torch.empty_like(x0), torch.empty_like(x0)))
    layer_out = {}
    for mode in ("layer_cublas_torch", "layer_fused", "layer_fused_pdl"):
        try:
            ms, h = layer_chain_ms(layers, norms, x0, cfgs, mode, args.iters)
            layer_out[mode] = h.float().clone()
            chains[mode] = {"ms": ms, "pct_roofline": roof_ms / ms * 100}
            print(f"[pdl {time.time() - t0:5.1f}s] chain {mode:24s} {ms:7.3f} ms  {roof_ms / ms * 100:5.1f} % "
                  f"of the {roof_ms:.3f} ms roofline (GEMVs + residual adds, norms, SwiGLU)", flush=True)
        except Exception as e:                             # noqa: BLE001
            chains[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"[pdl] chain {mode}: {chains[mode]['error']}", flush=True)
    if {"layer_cublas_torch", "layer_fused", "layer_fused_pdl"} <= set(layer_out):
        ref = layer_out["layer_cublas_torch"]
        for mode in ("layer_fused", "layer_fused_pdl"):
            chains[mode]["max_abs_diff_vs_cublas_torch"] = float((layer_out[mode] - ref).abs().max())
            chains[mode]["ref_max_abs"] = float(ref.abs().max())
        chains["layer_fused_pdl"]["equal_to_layer_fused"] = bool(torch.equal(layer_out["layer_fused"],
                                                                            layer_out["layer_fused_pdl"]))
        print(f"[pdl] fused layer chain vs cuBLAS + torch: max |diff| "
              f"{chains['layer_fused']['max_abs_diff_vs_cublas_torch']:.3g} of max |h| {float(ref.abs().max()):.3g}; "
              f"PDL equal to no PDL: {chains['layer_fused_pdl']['equal_to_layer_fused']}", flush=True)
    ref = None
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
