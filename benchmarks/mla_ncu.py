"""Runs the sparse MLA kernel (``sparse_mla.sparse_mla_attention_triton``) at the tune shape (DeepSeek-V4-Pro:
batch 64 x 8 tokens x 128 heads, latent 512, 256 index entries, ``benchmarks/plugins.mla_case``) a few times, for
a profiler to attach to (Nsight Compute); launch options as JSON, e.g. '{"group": 2, "num_warps": 8}':

    ncu --kernel-name regex:sparse_mla --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy python benchmarks/mla_ncu.py ['{...}']

Nothing is timed here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.plugins import mla_case  # noqa: E402
from dspark_trt.plugins.kernels.sparse_mla import sparse_mla_attention_triton  # noqa: E402


def main() -> None:
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    torch.manual_seed(0)
    args, _ = mla_case(64)
    for _ in range(4):
        sparse_mla_attention_triton(*args, **cfg)
    torch.cuda.synchronize()
    print(f"mla_ncu: done {cfg}")


if __name__ == "__main__":
    main()
