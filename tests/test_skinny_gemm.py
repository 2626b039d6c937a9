"""Skinny-GEMM kernel (issue #21) on CPU: the kernel through the Triton interpreter in a subprocess
(as tests/test_plugins_triton_interpret.py does), and the ``decode_linear`` dispatch, which must be
plain ``F.linear`` off CUDA, when disabled, and for shapes the measured table does not list."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton", reason="Triton is not installed")

from tests.skinny_gemm_cases import CASES  # noqa: E402

# fp32 accumulation then one bf16 rounding: <= 0.5 ulp on a GPU; the interpreter converts fp32 to
# bf16 by truncation (round toward zero), so < 1 ulp there; plus fp32 sum-order noise.
ULP_TOL = 1.05


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "skinny_gemm_cases.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


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
        assert sg.choose_config(5, 1024, 4096) == sg.default_config(5, 1024, 4096)
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


def test_decode_linear_off_by_default(monkeypatch):
    from dspark_trt.plugins.decode_linear import use_skinny_gemm
    monkeypatch.delenv("DSPARK_SKINNY_GEMM", raising=False)
    x = torch.empty(1, 64, device="meta", dtype=torch.bfloat16)
    assert not use_skinny_gemm(1, 24, 64, x, x)
