"""Why the compiled W8A8 step's ``fp8_gemm_kernel`` takes ~2x its benchmark time (issue #23;
``profile-compiled-w8a8-b1-c5bb067``: 38 us a call at 8 tokens in the 36-layer compiled step).

Per Qwen3-8B projection (fused q/k/v, o, fused gate/up, down) and token count, the same op timed
four ways in CUDA graphs over weight copies (> 5x L2, so weights come from HBM):
- ``eager``: ``dspark::fp8_linear`` with the bucket the compiled step's ``torch.cond`` picks (1 or 16);
- ``eager_two_pass``: the same launch with the split-K reduction a traced call gets (a second kernel);
- ``compiled``: ``torch.compile(dynamic=True)`` of ``fp8_linear_bucketed`` (the models' call);
- ``compiled_static``: ``torch.compile(dynamic=False)`` of the same (a concrete token count).
The generated code of the compiled case (one shape) is written beside the JSON; its
``triton_meta`` lines (the user kernel's signature and the argument divisibility inductor
assumed) are printed.

    python benchmarks/fp8_compiled_probe.py [--ms 1,8,16] [--w8a8-only] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
import importlib  # noqa: E402

fl = importlib.import_module("dspark_trt.plugins.fp8_linear")   # the package's attribute of that name is the op
from dspark_trt.plugins.kernels import skinny_gemm  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

PEAK = hbm_bytes_per_s()     # the GPU's own peak HBM rate (devices.HBM_BYTES_PER_S; without a GPU the H200's 4.8e12)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def bucket_of(m: int) -> int:
    return next((b for b in fl.TOKEN_BUCKETS if m <= b), fl.LARGE_BUCKET)


def time_variants(x, copies, act_quant: bool) -> dict[str, float]:
    M = x.shape[0]
    b = bucket_of(M)
    out = {"eager": graph_us([lambda c=c: torch.ops.dspark.fp8_linear(x, c[0], c[1], b, act_quant) for c in copies],
                             ITERS)}
    real = skinny_gemm.tracing
    skinny_gemm.tracing = lambda: True
    try:
        out["eager_two_pass"] = graph_us([lambda c=c: torch.ops.dspark.fp8_linear(x, c[0], c[1], b, act_quant)
                                          for c in copies], ITERS)
    finally:
        skinny_gemm.tracing = real
    for name, dynamic in (("compiled", True), ("compiled_static", False)):
        torch._dynamo.reset()
        f = torch.compile(lambda x, w, s: fl.fp8_linear_bucketed(x, w, s, act_quant=act_quant), dynamic=dynamic)
        xd = x.clone()
        if dynamic and M > 1:                    # a size of 1 is specialised (its own graph, as in the model)
            torch._dynamo.mark_dynamic(xd, 0)
        out[name] = graph_us([lambda c=c: f(xd, c[0], c[1]) for c in copies], ITERS)
    return out


def main():
    global ITERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rotate-mb", type=float, default=300.0)
    ap.add_argument("--w8a8-only", action="store_true")
    ap.add_argument("--code-shape", default="gate_up", help="shape whose compiled W8A8 code is saved (M = 8)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    ITERS = args.iters
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.time()
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        q, s = fl.quantize_fp8(torch.randn(N, K, device=dev) * 0.02)
        copies = [(q.clone(), s.clone()) for _ in range(max(2, int(args.rotate_mb * 2**20 / (N * K)) + 1))]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            for aq in ((True,) if args.w8a8_only else (False, True)):
                us = time_variants(x, copies, aq)
                gb = N * K + 4 * s.numel()
                row = {"shape": name, "N": N, "K": K, "M": M, "w8a8": aq, "bucket": bucket_of(M), "us": us,
                       "pct_hbm": {k: gb / (v * 1e-6) / PEAK * 100 for k, v in us.items()}}
                rows.append(row)
                print(f"[probe {time.time() - t0:6.1f}s] {name:8s} M={M:3d} {'w8a8' if aq else 'fp8 '} "
                      + "  ".join(f"{k} {v:7.2f} us" for k, v in us.items()), flush=True)
    # the generated code of one compiled W8A8 case
    from torch._inductor.utils import run_and_get_code
    N, K = SHAPES[args.code_shape]
    q, s = fl.quantize_fp8(torch.randn(N, K, device=dev) * 0.02)
    torch._dynamo.reset()
    x = torch.randn(8, K, device=dev, dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    f = torch.compile(lambda x, w, s: fl.fp8_linear_bucketed(x, w, s, act_quant=True), dynamic=True)
    _, codes = run_and_get_code(f, x, q, s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sha = provenance.git_sha()
    code_path = out / f"fp8-compiled-probe-code-{sha}.py"
    code_path.write_text("\n\n# ----- next module\n".join(codes))
    for line in "\n".join(codes).splitlines():
        if "triton_meta" in line or re.search(r"fp8_gemm_kernel|act_quant_kernel", line) and "def " in line:
            print("[code]", line.strip()[:900])
    rec = {"git_sha": sha, "gpu": provenance.gpu_name(), "versions": provenance.versions(),
           "command": " ".join(sys.argv), "iters": ITERS, "rotate_mb": args.rotate_mb, "peak_bytes_per_s": PEAK,
           "rows": rows, "code": code_path.name, "seconds": time.time() - t0}
    path = out / f"fp8-compiled-probe-{provenance.gpu_name().replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps(rec, indent=1))
    print("[probe] wrote", path)


ITERS = 30

if __name__ == "__main__":
    main()
