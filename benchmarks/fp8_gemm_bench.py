"""fp8 block-scaled GEMM on one GPU (issue #23): the weight-streaming Triton kernel
(``dspark_trt/plugins/kernels/fp8_gemm.py``: fp8 e4m3 weights, 128x128 fp32 block scales) vs bf16
cuBLAS (``F.linear``) at the Qwen3-8B projection shapes and the DeepSeek-V4-Flash attention /
indexer / shared-expert shapes (from the preset's config), for M = 1, 16, 64, 128 tokens.

Timing as ``skinny_gemm_bench.py``: CUDA-graph replays over weight copies totalling ``--rotate-mb``
(> 5x the 50 MB L2), so every call reads its weights from HBM; median of ``--iters`` replays.
Bandwidth = bytes moved / time (fp8: N*K + 4 B per scale block + x + y; bf16: 2*N*K + x + y), and
% of 4.8 TB/s. Every config is checked against ``F.linear(x, dequantised W)`` first (bf16 output
rounding + the reference's bf16 weight rounding). A small sweep per M (the default config first;
at M <= 4 then the same config with the ``.to(float32)`` decode instead of the bit pattern; above 4
also ``SCALE_W`` tiles, dequantised in registers and accumulated by the dot, whose best is reported
beside the block-scaled tiles' best);
the winners print as a ``CONFIGS`` literal for kernels/fp8_gemm.py. Every row also times
``by_m_config`` (the one launch for any M that engines and dynamic-shape compiles run). For M >= 64 also the opt-in
W8A8 variant (activations quantised per 128-group, fp8 tensor-core MMA; checked within 6 % of the
largest output: it rounds the activations), its time, TFLOP/s and speedup vs bf16 cuBLAS (try
``--ms 1,16,64,128,1024`` for a prefill-sized M).

``--w8a8`` also sweeps the in-kernel W8A8 path (``fp8_gemm(..., act_quant=True)``: x quantised per
(token, 128-column group) to fp8 inside the kernel, fp8 x fp8 ``tl.dot``; checked against
``F.linear`` of the two dequantised operands in fp32) and prints its winners as ``CONFIGS_W8A8``;
``--no-weight-only`` times only the weight-only default then.

Writes ``fp8-gemm-<gpu>-<sha>.json`` into $OUT (else benchmarks/results/). About 1-2 minutes on an
H200 (mostly Triton compilation: about 30 kernel variants).

    python benchmarks/fp8_gemm_bench.py [--shapes q,kv,...] [--ms 1,16,64,128] [--iters 30] [--out DIR]
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

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.config import get_preset  # noqa: E402
from dspark_trt.plugins.fp8_linear import dequantize_fp8, quantize_activations_fp8, quantize_fp8  # noqa: E402
from dspark_trt.plugins.kernels import fp8_gemm as fg  # noqa: E402

PEAK = 4.8e12
MS = (1, 16, 64, 128)


def shapes() -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight [N, K]: Qwen3-8B (each projection, and q/k/v and gate/up fused),
    V4-Flash and V4-Pro (attention wq_a / wq_b / wkv / wo_a / wo_b, the CSA indexer's wq_b, shared
    expert)."""
    q = get_preset("qwen3-8b-fp8-dspark-block7").target
    d, qd, kv, m = q.hidden_size, q.num_attention_heads * q.head_dim, q.num_key_value_heads * q.head_dim, \
        q.intermediate_size
    out = {"qwen3_q": (qd, d), "qwen3_kv": (kv, d), "qwen3_o": (d, qd), "qwen3_gate_up": (m, d),
           "qwen3_down": (d, m), "qwen3_qkv_fused": (qd + 2 * kv, d), "qwen3_gate_up_fused": (2 * m, d)}
    for tag, preset in (("v4f", "deepseek-v4-flash-dspark"), ("v4p", "deepseek-v4-pro-dspark")):
        c = get_preset(preset).target
        D, H, hd, ql, ol, g, h = (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank,
                                  c.o_lora_rank, c.o_groups, c.moe_intermediate_size)
        out.update({f"{tag}_wq_a": (ql, D), f"{tag}_wq_b": (H * hd, ql), f"{tag}_wkv": (hd, D),
                    f"{tag}_wo_a": (g * ol, H * hd // g), f"{tag}_wo_b": (D, g * ol),
                    f"{tag}_idx_wq_b": (c.index_n_heads * c.index_head_dim, ql),
                    f"{tag}_shared_w13": (h, D), f"{tag}_shared_w2": (D, h)})
    return out


def sweep(M: int, N: int, K: int) -> list[dict]:
    """The default config first (then, at M <= 4, the same with the bit-pattern decode), then a few
    tiles, each with the default rule's split and, where K allows, twice that split. At M <= 4 the
    CUDA-core tiles go up to 1024 K columns (several scale blocks per tile)."""
    base = fg.default_config(M, N, K)
    if M <= 4:
        tiles = [(128, 128, 8, 3, False, None), (32, 128, 4, 3, False, None), (16, 512, 4, 3, False, None),
                 (32, 256, 4, 3, False, None), (32, 512, 4, 3, False, None), (64, 256, 4, 3, False, None),
                 (64, 512, 8, 3, False, None), (16, 1024, 4, 2, False, None), (128, 256, 8, 3, False, None)]
    elif M <= 64:
        tiles = [(128, 128, 8, 4, True, None), (32, 128, 4, 4, True, None), (64, 64, 4, 6, True, None)]
    else:
        tiles = [(64, 128, 4, 4, True, None), (128, 128, 8, 3, True, 128), (128, 64, 8, 4, True, None)]
    if M > 4:                          # SCALE_W: tiles dequantised in registers, the dot accumulating
        bm_cap = 64 if M <= 64 else 128
        tiles += [(bn, bk, w, s, "scale_w", bm) for bn, bk, w, s, bm in (
            (64, 128, 4, 4, None), (64, 256, 4, 3, None), (128, 128, 8, 3, None), (32, 256, 4, 4, None),
            (128, 256, 8, 3, None)) + (((64, 128, 4, 3, bm_cap), (128, 128, 8, 3, bm_cap)) if M > 16 else ())]
    out = [base] + ([{**base, "BITS": True}] if M <= 4 else [])      # the CUDA-core body's bit-pattern decode
    for bn, bk, w, s, dot, bm in tiles:
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, DOT=bool(dot))
        if dot == "scale_w":
            cfg["SCALE_W"] = True
        if bm:
            cfg["BLOCK_M"] = bm
        n_tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm or 64)
        split = 1
        while n_tiles * split < 2 * fg.H200_SMS and K // (2 * split * bk) >= 4:
            split *= 2
        for sp in (split, 2 * split) if K // (2 * split * bk) >= 1 else (split,):
            c = {**cfg, "SPLIT_K": sp}
            if c not in out:
                out.append(c)
    return out


def w8a8_sweep(M: int, N: int, K: int) -> list[dict]:
    """W8A8 (``act_quant``) configs: the weight-only default made W8A8 (``w8a8_config``), then
    ``tl.dot`` tiles of 128 K columns (fp8 x fp8 tensor-core dots; 16-token tiles at M <= 16) with
    the default rule's split and twice it, and at M <= 2 the CUDA-core tiles; above 16 tokens each
    tl.dot config also with ``ACC_K`` 128 (fp32 additions once per group instead of every 32)."""
    out = [fg.w8a8_config(fg.default_config(M, N, K), None, N, K)]
    tiles = [(64, 4, 4), (64, 4, 3), (128, 8, 3), (128, 4, 3), (32, 4, 4), (64, 4, 6)]
    if M <= 2:
        out += [{**c, "BLOCK_K": max(128, c["BLOCK_K"])} for c in sweep(M, N, K) if not c.get("DOT") and not c.get("BITS")]
    for bn, w, st in tiles:
        bm = max(16, min(128, triton.next_power_of_2(M)))
        n_tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
        split = 1
        while n_tiles * split < 2 * fg.H200_SMS and K // (2 * split * 128) >= 4:
            split *= 2
        for sp in (split, 2 * split):
            c = dict(BLOCK_N=bn, BLOCK_K=128, num_warps=w, num_stages=st, DOT=True, BLOCK_M=bm, SPLIT_K=sp)
            if c not in out:
                out.append(c)
    if M > 16:                           # the fp8 dots added into fp32 once per 128 columns (DeepGEMM's interval)
        out += [{**c, "ACC_K": 128} for c in out if c.get("DOT")]
    return out


def measure(case: tuple, cfg: dict, rel_tol: float = 1e-2, act_quant: bool = False) -> dict:
    """``cfg`` on ``case`` = (x, fp8 weight copies, bf16 reference output, cuBLAS us, fp8 bytes, iters
    [, W8A8 reference output]): checked against the reference (within rel_tol of its largest entry),
    then timed."""
    x, q, ref, cublas, fp8_bytes, iters = case[:6]
    if act_quant:
        ref = case[6]
    M, K = x.shape
    N = q[0][0].shape[0]
    rec = {"config": cfg}
    try:
        y = fg.fp8_gemm(x, q[0][0], q[0][1], cfg, act_quant=act_quant)
        err = (y.float() - ref.float()).abs().max().item()
        rec.update(max_err=err, ok=err <= 1e-2 + rel_tol * ref.float().abs().max().item())
        us = graph_us([lambda w=w: fg.fp8_gemm(x, w[0], w[1], cfg, act_quant=act_quant) for w in q], iters)
        rec.update(us=us, pct=fp8_bytes / (us * 1e-6) / PEAK * 100, tb_per_s=fp8_bytes / us / 1e6,
                   tflops=2 * M * N * K / us / 1e6, speedup_vs_bf16=cublas / us)
    except Exception as e:                 # noqa: BLE001 - e.g. out of shared memory
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=1)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    all_shapes = shapes()
    ap.add_argument("--shapes", default=",".join(all_shapes))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rotate-mb", type=float, default=256.0)
    ap.add_argument("--w8a8", action="store_true", help="also sweep the W8A8 (act_quant) kernel per row")
    ap.add_argument("--no-weight-only", action="store_true", help="skip the weight-only sweep (default config only)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    t0 = time.time()
    rows, configs, configs_w8a8 = [], {}, {}
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        N, K = all_shapes[name]
        nblk = math.ceil(N / 128) * math.ceil(K / 128)
        copies = max(1, math.ceil(args.rotate_mb * 2**20 / (N * K)))          # fp8 copies
        q = [quantize_fp8(torch.randn(N, K, device=dev) * K ** -0.5) for _ in range(copies)]
        wb = [dequantize_fp8(w8, s, torch.bfloat16) for w8, s in q[:max(1, copies // 2)]]   # same bytes
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            act = M * K * 2 + M * N * 2
            fp8_bytes, bf16_bytes = N * K + 4 * nblk + act, 2 * N * K + act
            ref = F.linear(x, wb[0])
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in wb], args.iters)
            row = {"shape": name, "N": N, "K": K, "M": M, "copies": copies, "cublas_bf16_us": cublas,
                   "cublas_bf16_pct": bf16_bytes / (cublas * 1e-6) / PEAK * 100,
                   "fp8_bytes": fp8_bytes, "bf16_bytes": bf16_bytes, "configs": []}
            w8a8_ref = F.linear(quantize_activations_fp8(x), dequantize_fp8(*q[0], torch.float32)) if args.w8a8 else None
            case = (x, q, ref, cublas, fp8_bytes, args.iters, w8a8_ref)
            row["configs"] = [measure(case, cfg) for cfg in (sweep(M, N, K)[:1] if args.no_weight_only else sweep(M, N, K))]
            if args.w8a8:
                w8 = [measure(case, cfg, act_quant=True) for cfg in w8a8_sweep(M, N, K)]
                good8 = [r for r in w8 if r.get("ok") and "us" in r]
                row["w8a8_configs"] = w8
                if good8:
                    b8 = min(good8, key=lambda r: r["us"])
                    row["w8a8_best"] = {"us": b8["us"], "pct": b8["pct"], "config": b8["config"],
                                        "speedup_vs_bf16": cublas / b8["us"], "tflops": b8["tflops"]}
                    configs_w8a8[(fg.m_bucket(M), N, K)] = b8["config"]
            row["by_m"] = measure(case, fg.by_m_config(N, K))   # engines' one launch for any M (not swept)
            if M >= 64:                                # the opt-in W8A8 variant (activations to fp8)
                row["w8a8_mma"] = measure(case, fg.mma_config(M, N, K), rel_tol=6e-2)
            d0 = row["configs"][0]
            row["default_us"], row["default_pct"] = d0.get("us"), d0.get("pct")
            if M <= 4 and len(row["configs"]) > 1:
                row["bits_us"], row["bits_pct"] = row["configs"][1].get("us"), row["configs"][1].get("pct")
            good = [r for r in row["configs"] if r.get("ok") and "us" in r]
            best = min(good, key=lambda r: r["us"]) if good else None
            for tag, pick in (("scale_w", True), ("block_scaled", False)):   # the two tl.dot bodies' best
                sub = [r for r in good if r["config"].get("DOT") and bool(r["config"].get("SCALE_W")) == pick]
                if sub:
                    b = min(sub, key=lambda r: r["us"])
                    row[f"{tag}_best"] = {"us": b["us"], "pct": b["pct"], "config": b["config"]}
            if best:
                row.update(best_config=best["config"], fp8_us=best["us"], fp8_pct=best["pct"],
                           fp8_tb_per_s=best["tb_per_s"], speedup_vs_bf16=cublas / best["us"])
                configs[(fg.m_bucket(M), N, K)] = best["config"]
            bad = sum(1 for r in row["configs"] if not r.get("ok"))
            print(f"[{time.time() - t0:6.1f}s] {name:15s} N={N:6d} K={K:5d} M={M:3d}  bf16 cuBLAS {cublas:8.2f} us "
                  f"({row['cublas_bf16_pct']:5.1f}%)  fp8 " + (f"{best['us']:8.2f} us ({best['pct']:5.1f}% of HBM) "
                  f"x{cublas / best['us']:.2f} {best['config']}" if best else "none correct")
                  + (f"  [{bad} failed/incorrect]" if bad else "")
                  + "".join(f"  | {t} {row[t + '_best']['us']:.2f} us ({row[t + '_best']['pct']:.1f}%)"
                            for t in ("block_scaled", "scale_w") if t + "_best" in row)
                  + (f"  | by-M {row['by_m']['us']:.2f} us ({row['by_m']['pct']:.1f}%)"
                     f"{'' if row['by_m']['ok'] else ' INCORRECT'}" if "us" in row["by_m"] else "  | by-M failed")
                  + (f"  | W8A8 in-kernel {row['w8a8_best']['us']:.2f} us ({row['w8a8_best']['pct']:.1f}%) "
                     f"x{row['w8a8_best']['speedup_vs_bf16']:.2f} {row['w8a8_best']['config']}" if "w8a8_best" in row else "")
                  + (f"  | W8A8 MMA {row['w8a8_mma']['us']:.2f} us x{row['w8a8_mma']['speedup_vs_bf16']:.2f}"
                     f"{'' if row['w8a8_mma']['ok'] else ' INCORRECT'}" if "us" in row.get("w8a8_mma", {}) else ""),
                  flush=True)
            rows.append(row)
        del q, wb
        torch.cuda.empty_cache()

    sha, gpu = provenance.git_sha(), provenance.gpu_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp8-gemm-{gpu.replace(' ', '-')}-{sha}.json"
    lit = "CONFIGS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(configs.items())) + "}"
    if configs_w8a8:
        lit += "\nCONFIGS_W8A8 = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(configs_w8a8.items())) + "}"
    doc = {"git_sha": sha, "gpu": gpu, "versions": provenance.versions(), "command": " ".join(sys.argv),
           "peak_bytes_per_s": PEAK, "shapes": {s: all_shapes[s] for s in args.shapes.split(",")}, "ms": ms,
           "iters": args.iters, "rotate_mb": args.rotate_mb, "seconds": time.time() - t0, "rows": rows,
           "configs_literal": lit}
    path.write_text(json.dumps(doc, indent=1))
    print(f"\n{'shape':15s} {'M':>4s} {'bf16 %':>7s} {'fp8 %':>7s} {'fp8 dflt %':>10s} {'BITS %':>8s} {'x bf16':>7s}")
    for r in rows:
        if "fp8_us" in r:
            print(f"{r['shape']:15s} {r['M']:4d} {r['cublas_bf16_pct']:7.1f} {r['fp8_pct']:7.1f} "
                  f"{(r['default_pct'] or 0):10.1f} {(r.get('bits_pct') or 0):8.1f} {r['speedup_vs_bf16']:7.2f}"
                  + (f"   W8A8 {r['w8a8_best']['pct']:5.1f} % x{r['w8a8_best']['speedup_vs_bf16']:.2f}" if "w8a8_best" in r else ""))
    print("\n# measured winners for dspark_trt/plugins/kernels/fp8_gemm.py")
    print(lit)
    print(f"\nwrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
