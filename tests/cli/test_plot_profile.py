"""benchmarks/plot_profile.py: kernel names sorted into kinds, a profile's time split by kind
(what the top list leaves out counted as "other"), and a PNG written from two profiles."""
from __future__ import annotations

import json

import pytest

from tests.support.benchmark_scripts import load_benchmark

pp = load_benchmark("plot_profile")


def test_kernel_kinds():
    assert pp.kind_of("nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT") == "GEMM"
    assert pp.kind_of("void cublasLt::splitKreduce_kernel<32, 16, int>") == "split-K reduce"
    assert pp.kind_of("block_attention_reduce_kernel") == "attention"
    assert pp.kind_of("kv_cache_write_kernel") == "KV-cache write"
    assert pp.kind_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0").startswith("fused norm")
    assert pp.kind_of("void at::native::vectorized_elementwise_kernel<2, sin>") == "other"


def profile(gemm_us: float, total_us: float, kernels: int) -> dict:
    return {"kernels_per_call": kernels, "kernel_us_per_call": total_us,
            "top": [{"us_per_call": gemm_us, "calls": 36, "name": "nvjet_sm90_x"},
                    {"us_per_call": 50.0, "calls": 36, "name": "block_attention_split_kernel"}]}


def test_breakdown_counts_the_rest_as_other():
    b = pp.breakdown(profile(4000.0, 4100.0, 500))
    assert b["GEMM"] == 4000.0 and b["attention"] == 50.0 and b["other"] == pytest.approx(50.0)
    assert sum(b.values()) == pytest.approx(4100.0)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for sha, gemm in (("aaa", 4000.0), ("bbb", 3900.0)):
        p = tmp_path / f"profile-{sha}.json"
        p.write_text(json.dumps({"git_sha": sha, "networks": "compiled", "gpu": "X",
                                 "profiles": {"target_1": profile(gemm, gemm + 200, 500)}}))
        paths.append(str(p))
    out = tmp_path / "p.png"
    pp.plot([pp.load(p) for p in paths], ["a", "b"], "target_1", out, 4.8)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
