"""Instructions per weight in the one-token decode GEMV's K loop (``decode_gemv_kernel``), bf16 and
fp8 weights, from sm_90 SASS compiled on a CPU (``moe_decode_sass.py``'s tools; no GPU needed).

    python benchmarks/decode_gemv_sass.py [--tiles 8x512,8x1024,16x512,32x256] [--warps 4] [--out DIR]

Records the launch of a 4096 x 4096 projection (prologue "none") per tile, compiles it for
``GPUTarget("cuda", 90, 32)``, and counts the instructions of its longest loop per weight one
thread multiplies per iteration, with the opcodes (fp8: ``F2FP...E4M3`` unpacks two codes, then
one ``HADD2.F32`` and one ``FFMA`` per weight; shared-memory layout conversions show as
``STS`` / ``STSM`` / ``LDS`` with ``BAR.SYNC``). Writes ``decode-gemv-sass-sm90-<sha>.json`` to
``--out`` (git sha, Triton version, command, the counts per tile and weight kind).

``--rows M`` counts the few-token kernel's tensor-core loop instead (``decode_rows_kernel``, M tokens,
prologue "rmsnorm", split K 8; tiles e.g. 128x64,64x128,128x128), on bf16 weights and on fp8 weights
with bf16 operands and with the ``F16`` (fp16 operands) and ``X8`` (e4m3 operands) options; writes
``decode-rows-sass-sm90-<sha>.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import triton  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from benchmarks.moe_decode_sass import NVDISASM, loop_ops, on_cubin, registers  # noqa: E402
from dspark_trt.plugins.fp8_linear import quantize_fp8  # noqa: E402
from dspark_trt.plugins.kernels import decode_gemv as kdg  # noqa: E402
from tests.plugins.test_plugins_compile import _Recorder, compile_launch  # noqa: E402


def loop_instructions(w: torch.Tensor, scale, cfg: dict, M: int = 0):
    """(instructions per weight per thread and iteration, opcode counts, registers) of the K loop of
    ``decode_gemv``'s launch with tile ``cfg``: one token, prologue "none" (``M`` 0, the one-token
    kernel), or ``M`` tokens with the RMSNorm prologue (the rows kernel)."""
    from dspark_trt.plugins.kernels import decode_rows as kdr
    module = kdr if M else kdg
    K = w.shape[1]
    x, prologue, g = ((torch.randn(M, K).bfloat16(), "rmsnorm", torch.ones(K).bfloat16()) if M
                      else (torch.randn(K).bfloat16(), "none", None))
    rec, launcher = [], module.launcher
    module.launcher = _Recorder(rec)
    try:
        kdg.decode_gemv(x, w, prologue, norm_weight=g, w_scale=scale, config=cfg)
    finally:
        module.launcher = launcher
    kernel, args, kw = rec[0]
    cubin = compile_launch(kernel, args, kw).asm["cubin"]
    ops = loop_ops(on_cubin(cubin, NVDISASM, "-c"))
    return len(ops) / (cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"])), collections.Counter(ops), \
        registers(cubin)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="8x512,8x1024,16x512,32x256")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=0, help="M tokens: the rows kernel's tensor-core loop (module doc)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    rows = []
    w = torch.randn(4096, 4096)
    weights = {"bf16": (w.bfloat16(), None), "fp8": quantize_fp8(w)}
    if args.rows:
        weights.update(fp8_f16=weights["fp8"], fp8_x8=weights["fp8"])
    for tile in args.tiles.split(","):
        bn, bk = (int(v) for v in tile.split("x"))
        for name, (wt, scale) in weights.items():
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=args.warps)
            if args.rows:
                cfg.update(SPLIT_K=8, DOT=True, num_stages=3, F16=name == "fp8_f16", X8=name == "fp8_x8")
            per, ops, regs = loop_instructions(wt, scale, cfg, args.rows)
            rows.append(dict(weights=name, tile=tile, num_warps=args.warps, per_weight=round(per, 3),
                             per_iteration=sum(ops.values()), registers=regs, opcodes=dict(ops.most_common())))
            print(f"{name:4s} {tile:8s} {sum(ops.values()):4d} per iteration, {per:.2f} per weight, {regs} registers, "
                  f"barriers {ops['BAR.SYNC.DEFER_BLOCKING']}; top {ops.most_common(6)}", flush=True)
    sha = provenance.git_sha()
    out = Path(args.out) / f"decode-{'rows' if args.rows else 'gemv'}-sass-sm90-{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(git_sha=sha, target="sm_90 (compiled on a CPU, no GPU)", triton=triton.__version__,
                                   shape=f"N 4096 x K 4096, {args.rows} tokens, prologue rmsnorm, split K 8"
                                   if args.rows else "N 4096 x K 4096, one token, prologue none",
                                   command="python benchmarks/decode_gemv_sass.py " + " ".join(sys.argv[1:]),
                                   rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
