"""Runs the MoE decode GEMVs (``moe_decode.decode_experts``, MXFP4 e4m3 route) at V4-Flash expert
shapes for one token a few times, for a profiler to attach to (Nsight Compute):

    ncu --kernel-name regex:moe_decode --launch-skip 3 --launch-count 3 --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section SpeedOfLight python benchmarks/moe_decode_ncu.py

Eight experts of random bytes (E8M0 116..119), six chosen; nothing is timed here.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dspark_trt.plugins.kernels.moe_decode import decode_experts  # noqa: E402


def main() -> None:
    d, h, E, k = 4096, 2048, 8, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    byte = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, device="cuda", generator=g, dtype=torch.uint8)  # noqa: E731
    w13, w2 = (byte(E, 2 * h, d // 2), byte(E, 2 * h, d // 32, lo=116, hi=120)), (byte(E, d, h // 2),
                                                                                 byte(E, d, h // 32, lo=116, hi=120))
    x = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    ids = torch.randperm(E, device="cuda", generator=g)[:k].view(1, k)
    w = torch.rand(1, k, device="cuda", generator=g)
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        decode_experts(x, ids, w, w13, w2, 0, 10.0, h, decode="e4m3", pdl=False)
    torch.cuda.synchronize()
    print("moe_decode_ncu: done")


if __name__ == "__main__":
    main()
