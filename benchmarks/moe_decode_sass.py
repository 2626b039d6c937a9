"""Instructions per weight in the MoE decode GEMVs' K loop, from sm_90 SASS compiled on a CPU.

    python benchmarks/moe_decode_sass.py [--decode words,bytes,e4m3] [--tile 16,512,4]

Records ``decode_experts``' launches for V4-Flash expert shapes (d=4096, h=2048, MXFP4), compiles
each for ``GPUTarget("cuda", 90, 32)`` with the ptxas Triton ships, disassembles it with its
nvdisasm and counts the instructions of the gate/up kernel's loop body (the block between a label
and the branch back to it), per weight one thread decodes per iteration. No GPU needed.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import triton  # noqa: E402

from dspark_trt.plugins.kernels import moe_decode as kmd  # noqa: E402
from tests.plugins.test_plugins_compile import _Recorder, compile_launch  # noqa: E402
from tests.support.plugins_cases import moe_mxfp4_inputs  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
CUOBJDUMP = os.path.join(os.path.dirname(NVDISASM), "cuobjdump")
_ADDR = re.compile(r"/\*[0-9a-f]{4}\*/")


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the longest backward-branch loop in a disassembly."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\.L_x_(\d+):", l.strip()))}
    best: list[str] = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", l)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if _ADDR.search(x)]
            ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", x).split()[0].rstrip(";") for x in body]
            best = max(best, ops, key=len)
    return best


def on_cubin(cubin: bytes, *tool: str) -> str:
    """The output of ``tool`` (e.g. nvdisasm -c) run on ``cubin`` written to a temporary file."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([*tool, f.name], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes) -> int:
    """Registers per thread of the one kernel in ``cubin`` (cuobjdump's resource usage)."""
    return int(re.search(r"REG:(\d+)", on_cubin(cubin, CUOBJDUMP, "-res-usage")).group(1))


def loop_instructions(decode: str, block_n=None, block_k=None, num_warps=None) -> tuple[float, collections.Counter, int]:
    """(instructions per weight one thread decodes per iteration, opcode counts, registers per
    thread) of the MXFP4 gate/up kernel's K loop with the E2M1 route ``decode``, V4-Flash expert
    shapes (3 tokens: 18 pairs, below ``DECODE_WIDE_PAIRS``), sm_90; the one-token default tile unless given."""
    x, ids, w, w13, s13, w2, s2, fe, lim = moe_mxfp4_inputs("cpu", torch.bfloat16, M=3, k=6, E=8, d=4096, h=2048)
    launch = dict(block_n=block_n, block_k=block_k, num_warps=num_warps)
    rec, launcher = [], kmd.launcher
    kmd.launcher = _Recorder(rec)
    try:
        kmd.decode_experts(x, ids, w, (w13, s13), (w2, s2), fe, lim, 2048, decode=decode,
                           **{k: v for k, v in launch.items() if v is not None})
    finally:
        kmd.launcher = launcher
    kernel, a, kw = next(r for r in rec if r[0] is kmd.moe_decode_gate_up_kernel)
    cubin = compile_launch(kernel, a, kw).asm["cubin"]
    ops = loop_ops(on_cubin(cubin, NVDISASM, "-c"))
    weights = kw["BLOCK_N"] * kw["BLOCK_K"] // (32 * kw["num_warps"])     # gate and up rows together, per thread
    return len(ops) / weights, collections.Counter(ops), registers(cubin)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", default="words,bytes,e4m3")
    ap.add_argument("--tile", default="", help="block_n,block_k,num_warps for every route")
    args = ap.parse_args()
    tile = dict(zip(("block_n", "block_k", "num_warps"), map(int, filter(None, args.tile.split(",")))))
    for decode in args.decode.split(","):
        per_weight, count, regs = loop_instructions(decode, **tile)
        print(f"{decode}: {sum(count.values())} instructions per iteration, {per_weight:.2f} per weight, "
              f"barriers {count['BAR.SYNC.DEFER_BLOCKING']}, {regs} registers; top {count.most_common(6)}")


if __name__ == "__main__":
    main()
