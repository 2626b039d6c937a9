"""Skinny-GEMM kernel cases under ``TRITON_INTERPRET=1`` (run as a subprocess by
tests/test_skinny_gemm.py): prints ``RESULT {json}`` with, per case, the error in bf16 ulps
against ``x.float() @ w.float().T`` and whether two calls were bitwise equal."""
from __future__ import annotations

import json
import os

import torch


# (name, M, N, K, config): odd N (not a multiple of BLOCK_N), K not a multiple of BLOCK_K,
# split-K with both reductions, both bodies (CUDA-core M <= 4, tl.dot otherwise), M tiling.
CASES = [
    ("m1_splitk", 1, 37, 200, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    ("m1_nosplit", 1, 24, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1)),
    ("m3_splitk4", 3, 40, 256, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=4)),
    ("m3_dot", 3, 40, 200, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, DOT=True)),
    ("m8_two_pass", 8, 33, 160, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, REDUCE="two_pass")),
    ("m8_ticket", 8, 33, 160, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, REDUCE="ticket")),
    ("m8_cudacore", 8, 33, 160, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, DOT=False)),
    ("m16_default", 16, 64, 128, None),
    ("m16_splitk_oddk", 16, 50, 100, dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)),
    ("m64_splitk", 64, 48, 192, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3)),
    ("m40_mtiles", 40, 20, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, BLOCK_M=16)),
]


def ulp_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| in units of one bf16 ulp of |ref| (>= 1 ulp of 2^-8 near zero)."""
    ulp = torch.clamp(ref.abs(), min=1.0)
    ulp = 2.0 ** (torch.floor(torch.log2(ulp)) - 7)
    return float(((y.float() - ref).abs() / ulp).max())


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1"          # set before triton is imported
    from dspark_trt.plugins.kernels.skinny_gemm import choose_config, skinny_gemm
    out = {}
    for i, (name, M, N, K, cfg) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        ref = x.float() @ w.float().T
        y1 = skinny_gemm(x, w, cfg)
        y2 = skinny_gemm(x, w, cfg)
        out[name] = {"ulp": ulp_err(y1, ref), "bitwise": bool(torch.equal(y1, y2)),
                     "dtype": str(y1.dtype), "shape": list(y1.shape)}
    # both reductions sum the same partials in the same order
    g = torch.Generator().manual_seed(99)
    x = torch.randn(8, 160, generator=g).bfloat16()
    w = torch.randn(33, 160, generator=g).bfloat16()
    a = skinny_gemm(x, w, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, REDUCE="two_pass"))
    b = skinny_gemm(x, w, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, REDUCE="ticket"))
    out["reduce_equal"] = bool(torch.equal(a, b))
    out["default_split"] = choose_config(1, 1024, 4096)["SPLIT_K"]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
