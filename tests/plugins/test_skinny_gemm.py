"""Skinny-GEMM kernel (issue #21) on CPU: the kernel through the Triton interpreter in a subprocess
(as tests/plugins/test_plugins_triton_interpret.py does), and the ``decode_linear`` dispatch, which must be
plain ``F.linear`` off CUDA, when disabled, and for shapes the measured table does not list."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed")

from tests.support.interpreter import interpreter_results  # noqa: E402
from tests.support.skinny_gemm_cases import CASES  # noqa: E402

# fp32 accumulation then one bf16 rounding: <= 0.5 ulp on a GPU; the interpreter converts fp32 to
# bf16 by truncation (round toward zero), so < 1 ulp there; plus fp32 sum-order noise.
ULP_TOL = 1.05


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results("tests.support.skinny_gemm_cases")


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_kernel_matches_fp32_reference(results, name):
    r = results[name]
    M, N = next((c[1], c[2]) for c in CASES if c[0] == name)
    assert r["shape"] == [M, N] and r["dtype"] == "torch.bfloat16"
    assert r["ulp"] <= ULP_TOL, r
    assert r["bitwise"], "two calls differ: the split-K reduction is not deterministic"


def test_ticket_and_two_pass_reductions_agree(results):
    assert results["reduce_equal"]


def test_default_config_splits_small_n(results):
    assert results["default_split"] > 1


def test_choose_config_table_and_buckets():
    from dspark_trt.plugins.kernels import skinny_gemm as sg
    assert [sg.m_bucket(m) for m in (1, 2, 3, 5, 8, 9, 64, 65, 500)] == [1, 2, 4, 8, 8, 16, 64, 128, 128]
    cfg = {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 4, "num_warps": 2, "num_stages": 2}
    sg.CONFIGS[(4, 1024, 4096)] = cfg
    try:
        assert sg.choose_config(3, 1024, 4096) == cfg
        assert sg.choose_config(5, 1000, 4096) == sg.default_config(5, 1000, 4096)   # not in the table
    finally:
        del sg.CONFIGS[(4, 1024, 4096)]
    big = sg.default_config(1, 151936, 4096)
    assert big["SPLIT_K"] == 1 and not big["DOT"] and sg.default_config(16, 6144, 4096)["DOT"]


def test_decode_linear_is_f_linear_on_cpu(monkeypatch):
    from dspark_trt.plugins.decode_linear import DecodeLinear, decode_linear, use_skinny_gemm
    from dspark_trt.plugins.kernels import skinny_gemm as sg
    monkeypatch.setenv("DSPARK_SKINNY_GEMM", "1")
    monkeypatch.setitem(sg.TRITON_WINS, (8, 24, 64), True)
    x = torch.randn(2, 4, 64).bfloat16()
    w = torch.randn(24, 64).bfloat16()
    assert not use_skinny_gemm(8, 24, 64, x, w)              # CPU tensors: never the kernel
    assert torch.equal(decode_linear(x, w), F.linear(x, w))
    lin = torch.nn.Linear(64, 24, bias=False).bfloat16()
    assert torch.equal(DecodeLinear.from_linear(lin)(x), lin(x))
    with pytest.raises(ValueError):
        DecodeLinear.from_linear(torch.nn.Linear(4, 4))


def _bench_rows():
    """Rows as benchmarks/skinny_gemm_bench.py writes them: a win, a loss, a shape without a
    correct config."""
    cfg = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "DOT": False, "SPLIT_K": 2}
    return [{"shape": "o", "N": 4096, "K": 4096, "M": 1, "cublas_us": 12.0, "best_config": cfg, "triton_us": 10.0},
            {"shape": "o", "N": 4096, "K": 4096, "M": 3, "cublas_us": 12.0, "best_config": dict(cfg, SPLIT_K=4),
             "triton_us": 11.9},
            {"shape": "kv", "N": 1024, "K": 4096, "M": 8, "cublas_us": 7.0}]


def test_tables_from_bench_rows_and_load(tmp_path, monkeypatch):
    from dspark_trt.plugins import decode_linear as dl
    from dspark_trt.plugins.kernels import skinny_gemm as sg
    configs, wins = sg.tables_from_rows(_bench_rows(), win=0.02)
    assert wins == {(1, 4096, 4096): True, (4, 4096, 4096): False}      # 11.9 us is not 2 % faster
    assert configs[(4, 4096, 4096)]["SPLIT_K"] == 4 and (8, 1024, 4096) not in configs
    monkeypatch.setattr(sg, "CONFIGS", dict(sg.CONFIGS))
    monkeypatch.setattr(sg, "TRITON_WINS", dict(sg.TRITON_WINS))
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps({"rows": _bench_rows(), "win": 0.25}))
    monkeypatch.setenv(dl.TABLE_ENV, str(path))
    monkeypatch.setattr(dl, "_loaded_table", [])
    assert dl._table() is sg
    assert sg.TRITON_WINS == {(1, 4096, 4096): False, (4, 4096, 4096): False}   # the file's own margin
    assert sg.choose_config(1, 4096, 4096) == _bench_rows()[0]["best_config"]
    path.write_text("{not json")
    monkeypatch.setattr(dl, "_loaded_table", [])
    with pytest.raises(ValueError, match="skinny.json.*not a skinny_gemm_bench.py result"):
        dl._table()


def test_decode_linear_off_by_default(monkeypatch):
    from dspark_trt.plugins.decode_linear import use_skinny_gemm
    monkeypatch.delenv("DSPARK_SKINNY_GEMM", raising=False)
    x = torch.empty(1, 64, device="meta", dtype=torch.bfloat16)
    assert not use_skinny_gemm(1, 24, 64, x, x)


def test_llm_swaps_linears_when_enabled_and_generates_the_same(monkeypatch):
    """DSPARK_SKINNY_GEMM=1: LLM's eager modules use DecodeLinear (here on CPU: F.linear, so the
    tokens must be identical to the unswapped model's)."""
    from dspark_trt.models import build_models
    from dspark_trt.plugins.decode_linear import DecodeLinear
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.sampling_params import SamplingParams
    from tests.support.models import tiny_pair
    outs, swapped = [], []
    for env in ("0", "1"):
        monkeypatch.setenv("DSPARK_SKINNY_GEMM", env)
        pair = tiny_pair()
        target, draft = build_models(pair, torch.float64, "cpu", seed=3)
        llm = LLM(pair, target, draft, max_batch_size=2, max_seq_len=64, page_size=8)
        swapped.append(sum(isinstance(m, DecodeLinear) for m in llm.target.modules()))
        outs.append(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12))[0].output_ids)
    assert swapped[0] == 0 and swapped[1] > 0
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_configs_on_gpu():
    """Every (M bucket, N, K) the table routes to Triton: equals the fp32 product within bf16
    rounding, bitwise run-to-run, and decode_linear takes the kernel for it."""
    from dspark_trt.plugins.decode_linear import use_skinny_gemm
    from dspark_trt.plugins.kernels import skinny_gemm as sg
    g = torch.Generator(device="cuda").manual_seed(0)
    for (mb, N, K) in sorted(k for k, win in sg.TRITON_WINS.items() if win):
        M = mb if mb == 1 else mb - 1                        # a row count inside the bucket
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
        y = sg.skinny_gemm(x, w)
        ref = x.float() @ w.float().T
        assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2), (mb, N, K)
        assert torch.equal(y, sg.skinny_gemm(x, w)), (mb, N, K)
        assert use_skinny_gemm(M, N, K, x, w, enabled=True)
