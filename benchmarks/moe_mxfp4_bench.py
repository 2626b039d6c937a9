"""MXFP4 routed experts on one GPU (issue #23): ``dspark::moe_experts_mxfp4``'s Triton kernels
(packed E2M1 + E8M0 per 32) against the bf16 ``dspark::moe_experts`` kernels on the same chosen
experts, at the DeepSeek-V4-Flash and V4-Pro routed-expert shapes (from the presets: hidden d,
moe_intermediate h, n_routed_experts E, num_experts_per_tok k), for M = 1..64 tokens (top-k distinct
random experts per token).

Timing as ``benchmarks/plugins.py``: each call replayed in a CUDA graph, cold L2 (replays of
[256 MB flush + call] minus replays of the flush alone; median of CUDA-event batches). Bytes = the
chosen experts' weights actually read (U distinct experts x 3 d h x 0.53125 B for MXFP4, x 2 B for
bf16) + x, routing and output; bandwidth as % of 4.8 TB/s. The bf16 weights are the MXFP4 ones
dequantised (exact), so both formats compute the same products: parity is the max abs difference
to the bf16 grouped output, against its scale. Schedules: the GEMV decode schedule
(``kernels/moe_decode.py``, the op's choice up to ``DECODE_MAX_PAIRS`` pairs; its tile sweep at
--sweep-ms; the fp8-conversion route's tiles at --e4m3-sweep-ms; ``mxfp4_gemv_e4m3_nopdl``: without
programmatic dependent launch) and the grouped kernels (``tl.dot_scaled``, the op's choice above; the in-register
decode at --grouped-decode-ms), for bf16 the grouped and the GEMV schedule; failures are recorded.

Writes ``moe-mxfp4-<gpu>-<sha>.json`` into --out ($OUT, else benchmarks/results/): git sha, GPU
name, versions, shapes, the command. About 2-3 minutes on an H200 (V4-Pro's bf16 experts: 51 GB).

    python benchmarks/moe_mxfp4_bench.py [--models flash,pro] [--ms 1,2,4,8,16,32,64] [--sweep-ms 1,16]
        [--e4m3-sweep-ms 1,16] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.plugins import err, graph_time, timeit  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.config import get_preset  # noqa: E402
from dspark_trt.plugins.kernels import moe as kmoe  # noqa: E402
from dspark_trt.plugins.kernels.moe_decode import (DECODE_DEFAULTS, DECODE_MAX_PAIRS, DECODE_WIDE,  # noqa: E402
                                                   DECODE_WIDE_PAIRS)
from dspark_trt.plugins.moe_experts_mxfp4 import MXFP4_GROUP, dequantize_mxfp4  # noqa: E402

PEAK = 4.8e12
DEV = "cuda"
MODELS = {"flash": "deepseek-v4-flash-dspark", "pro": "deepseek-v4-pro-dspark"}
# MXFP4 variants: the GEMV decode schedule (kernels/moe_decode.py, the op's choice up to
# DECODE_MAX_PAIRS pairs) at its defaults (E2M1 from int32 words of 8 codes; from single bytes; through the fp8
# conversion, e4m3), the grouped kernels with tl.dot_scaled (the op's choice
# above) and with the in-register decode; --sweep-ms adds GEMV tiles.
VARIANTS = {"mxfp4_gemv": dict(schedule="decode"),
            "mxfp4_gemv_bytes": dict(schedule="decode", decode="bytes"),
            "mxfp4_gemv_e4m3": dict(schedule="decode", decode="e4m3"),
            "mxfp4_gemv_e4m3_nopdl": dict(schedule="decode", decode="e4m3", pdl=False),
            "mxfp4_grouped_dot_scaled": dict(schedule="grouped", dot_scaled=True),
            "mxfp4_grouped_decode": dict(schedule="grouped")}
GEMV_SWEEP = [dict(block_n=n, block_k=k, num_warps=w) for n in (8, 16, 32) for k in (256, 512, 1024) for w in (4, 8)]
# the fp8-conversion route's tiles (block_n weight rows per program: gate/up programs hold block_n / 2 gate and
# as many up rows; the op takes the first below DECODE_WIDE_PAIRS pairs, the second from there). An H100 at
# 577fe7e also timed each with its next weight tile loaded ahead (slower at every tile and size: one V4-Flash
# token 45.9 -> 51.5 us) and under maxnreg 80 (46.8), and 16 / 32 x 1024 tiles (47.9-55.8 us).
E4M3_SWEEP = [dict(decode="e4m3", block_n=n, block_k=k, num_warps=w, k_stages=s) for n, k, w, s in (
    (16, 512, 4, 1), (32, 256, 4, 1), (64, 256, 8, 1), (16, 512, 4, 2), (16, 512, 4, 3), (16, 256, 4, 3),
    (16, 256, 4, 4), (32, 256, 4, 3))]
# the bf16 GEMVs' tile beside the default (16 rows: before the gate/up rows were interleaved its programs held 32)
DENSE_SWEEP = [dict(block_n=32), dict(k_stages=3), dict(k_stages=4)]
# variant names: e4m3_n16_k256_w4_s1
SHORT = {"block_n": "n", "block_k": "k", "num_warps": "w", "maxnreg": "r", "k_stages": "s"}


def variant_name(prefix: str, kw: dict) -> str:
    """e.g. ``mxfp4_gemv_e4m3_n16_k512_w4``: the launch options in SHORT's letters."""
    return prefix + "_".join(v if k == "decode" else f"{SHORT[k]}{int(v)}" for k, v in kw.items())


def shape(model: str) -> dict:
    c = get_preset(MODELS[model]).target
    return dict(d=c.hidden_size, h=c.moe_intermediate_size, E=c.n_routed_experts, k=c.num_experts_per_tok)


def weights(d: int, h: int, E: int, gen: torch.Generator):
    """MXFP4 (w13_packed, w13_scale, w2_packed, w2_scale) of random bytes, E8M0 116..119 (|w| <= 6 *
    2^-8), and the same experts in bf16 (dequantised one expert at a time)."""
    byte = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, device=DEV, generator=gen, dtype=torch.uint8)  # noqa: E731
    mx = (byte(E, 2 * h, d // 2), byte(E, 2 * h, d // MXFP4_GROUP, lo=116, hi=120),
          byte(E, d, h // 2), byte(E, d, h // MXFP4_GROUP, lo=116, hi=120))
    w13 = torch.empty(E, 2 * h, d, device=DEV, dtype=torch.bfloat16)
    w2 = torch.empty(E, d, h, device=DEV, dtype=torch.bfloat16)
    for e in range(E):
        w13[e] = dequantize_mxfp4(mx[0][e], mx[1][e], torch.bfloat16)
        w2[e] = dequantize_mxfp4(mx[2][e], mx[3][e], torch.bfloat16)
    return mx, (w13, w2)


def routing(M: int, d: int, E: int, k: int, gen: torch.Generator):
    x = torch.randn(M, d, device=DEV, generator=gen).to(torch.bfloat16)
    ids = torch.rand(M, E, device=DEV, generator=gen).topk(k, -1).indices
    w = torch.rand(M, k, device=DEV, generator=gen)
    return x, ids, w


def parse(csv: str) -> list[int]:
    return [int(m) for m in csv.split(",") if m]


def measure(fn) -> dict:
    plain = timeit(fn)
    warm, cold = graph_time(fn, plain)
    return dict(plain_us=plain * 1e6, graph_us=warm * 1e6, cold_us=cold * 1e6)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep-ms", default="1,16", help="token counts at which GEMV_SWEEP's tiles also run")
    ap.add_argument("--e4m3-sweep-ms", default="1,16", help="token counts at which E4M3_SWEEP's tiles also run")
    ap.add_argument("--grouped-decode-ms", default="1,16", help="token counts for mxfp4_grouped_decode (slow)")
    ap.add_argument("--limit", type=float, default=10.0, help="swiglu_limit")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    global PEAK
    PEAK = hbm_bytes_per_s()                    # the GPU's own (4.8 TB/s: the H200's)
    t0, rows, shapes = time.time(), [], {}
    sha, gpu = provenance.git_sha(), provenance.gpu_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"moe-mxfp4-{gpu.replace(' ', '-')}-{sha}.json"

    def write():                                   # after every row: a run cut short keeps its rows
        doc = {"git_sha": sha, "gpu": gpu, "versions": provenance.versions(), "command": " ".join(sys.argv),
               "peak_bytes_per_s": PEAK, "shapes": shapes, "swiglu_limit": args.limit,
               "defaults": kmoe.MOE_DEFAULTS, "decode_defaults": DECODE_DEFAULTS,
               "decode_wide": DECODE_WIDE, "decode_wide_pairs": DECODE_WIDE_PAIRS,
               "decode_max_pairs": DECODE_MAX_PAIRS, "seconds": time.time() - t0, "rows": rows}
        path.write_text(json.dumps(doc, indent=1))

    gen = torch.Generator(device=DEV).manual_seed(0)
    for model in args.models.split(","):
        s = shapes[model] = shape(model)
        d, h, E, k = s["d"], s["h"], s["E"], s["k"]
        mx, (w13, w2) = weights(d, h, E, gen)
        per_mx, per_bf16 = 3 * d * h // 2 + 3 * d * h // MXFP4_GROUP, 3 * d * h * 2     # bytes per expert
        for M in parse(args.ms):
            x, ids, w = routing(M, d, E, k, gen)
            used = int(ids.unique().numel())
            act = M * d * 2 * 2 + M * k * (8 + 4)                                      # x, y; ids, weights
            row = {"model": model, **s, "M": M, "experts_read": used,
                   "mxfp4_bytes": used * per_mx + act, "bf16_bytes": used * per_bf16 + act}
            want = kmoe.moe_experts_triton(x, ids, w, w13, w2, 0, args.limit, schedule="grouped")
            scale = float(want.float().abs().max())
            dense = {"bf16": dict(schedule="grouped"), "bf16_gemv": dict(schedule="decode")}
            if M in parse(args.e4m3_sweep_ms):
                dense.update({variant_name("bf16_gemv_", kw): dict(schedule="decode", **kw) for kw in DENSE_SWEEP})
            for name, kw in dense.items():
                row[name] = measure(lambda kw=kw: kmoe.moe_experts_triton(x, ids, w, w13, w2, 0, args.limit, **kw))
                row[name]["pct"] = row["bf16_bytes"] / (row[name]["cold_us"] * 1e-6) / PEAK * 100
            row["bf16_gemv"]["max_diff_vs_bf16"] = err(
                kmoe.moe_experts_triton(x, ids, w, w13, w2, 0, args.limit, schedule="decode"), want)
            variants = {n: kw for n, kw in VARIANTS.items()
                        if n != "mxfp4_grouped_decode" or M in parse(args.grouped_decode_ms)}
            if M in parse(args.sweep_ms):
                variants.update({"mxfp4_gemv_n{block_n}_k{block_k}_w{num_warps}".format(**kw): dict(schedule="decode", **kw)
                                 for kw in GEMV_SWEEP})
            if M in parse(args.e4m3_sweep_ms):
                variants.update({variant_name("mxfp4_gemv_", kw): dict(schedule="decode", **kw) for kw in E4M3_SWEEP})
            for name, kw in variants.items():
                rec = {"config": kw}
                try:
                    fn = lambda kw=kw: kmoe.moe_experts_mxfp4_triton(x, ids, w, *mx, 0, args.limit, **kw)  # noqa: E731
                    got = fn()
                    rec.update(max_diff_vs_bf16=err(got, want), scale=scale)
                    rec["ok"] = rec["max_diff_vs_bf16"] <= 2e-2 * scale
                    rec.update(measure(fn))
                    rec["pct"] = row["mxfp4_bytes"] / (rec["cold_us"] * 1e-6) / PEAK * 100
                    rec["speedup_vs_bf16"] = row["bf16"]["cold_us"] / rec["cold_us"]
                except Exception as e:                     # noqa: BLE001 - e.g. out of shared memory
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=1)
                row[name] = rec
            rows.append(row)
            write()
            best = min((r for n, r in row.items() if n.startswith("mxfp4_") and isinstance(r, dict)
                        and r.get("ok")), key=lambda r: r["cold_us"], default=None)
            gemv = row["mxfp4_gemv"]
            print(f"[{time.time() - t0:6.1f}s] {model:5s} d={d} h={h} E={E} k={k} M={M:3d} experts read {used:3d}: "
                  f"bf16 {row['bf16']['cold_us']:8.1f} us ({row['bf16']['pct']:5.1f}%) bf16 gemv "
                  f"{row['bf16_gemv']['cold_us']:8.1f} us ({row['bf16_gemv']['pct']:5.1f}%)  mxfp4 gemv "
                  + (f"{gemv['cold_us']:8.1f} us ({gemv['pct']:5.1f}%) e4m3 "
                     f"{row['mxfp4_gemv_e4m3'].get('cold_us', float('nan')):8.1f} us "
                     f"({row['mxfp4_gemv_e4m3'].get('pct', float('nan')):5.1f}%) no pdl "
                     f"{row['mxfp4_gemv_e4m3_nopdl'].get('cold_us', float('nan')):8.1f} us dot_scaled "
                     f"{row['mxfp4_grouped_dot_scaled'].get('cold_us', float('nan')):8.1f} us"
                     if "cold_us" in gemv else gemv.get("error", "?"))
                  + (f"  best {best['cold_us']:9.1f} us ({best['pct']:5.1f}%) x{best['speedup_vs_bf16']:.2f} "
                     f"{best['config']}" if best else "  none correct"), flush=True)
        del mx, w13, w2
        torch.cuda.empty_cache()
    write()
    print(f"wrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
