"""One-token GEMV with fused prologues (``kernels/decode_gemv.py``, issue #21): the kernel through
the Triton interpreter in a subprocess (as test_skinny_gemm.py), its argument checks, and on a GPU
the Qwen3-8B shapes with and without programmatic dependent launch; bf16 weights, and fp8 e4m3
weights with 128 x 128 block scales."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from tests.support.interpreter import interpreter_results  # noqa: E402
from tests.support.decode_gemv_cases import CASES, FP8_CASES, reference  # noqa: E402
from tests.support.skinny_gemm_cases import ulp_err  # noqa: E402

ULP_TOL = 1.05          # fp32 sums, one bf16 rounding (the interpreter truncates: < 1 ulp), sum-order noise
# Two or more tokens with RMSNorm: the deferred scale rounds h * g, not h * rstd * g (decode_rows.py), so
# the result is held against the prologue in fp32: within one ulp more than the modules' own result.
DEFERRED_ULP = 1.0


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results("tests.support.decode_gemv_cases")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_the_modules_prologue_times_w(results, case):
    """y equals (the model's RMSNorm / SwiGLU / residual sum of x) @ w^T within one bf16 ulp, for
    one token and for M tokens (each row its own norm; split K included), and the residual sum
    written by the first programs is torch's bf16 sum bit for bit. RMSNorm on the rows kernel (two
    or more tokens, or one with a ROWS tile: a deferred scale): as close to the fp32 prologue's
    product as the modules' result, plus one ulp. A ``PREFETCH`` or ``K_STAGES`` tile gives the bits of
    the same tile without it."""
    _assert_case(results, case)


@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_weights_match_the_dequantised_weights(results, case):
    """fp8 e4m3 weights with 128 x 128 block scales (``w_scale``), on every body and prologue: held as
    the bf16 cases are against the same prologue times the dequantised weight in fp32 (the scale taken
    into the activations in fp32; under the interpreter the tensor-core body's dot is fp32 too),
    the residual sum written bit for bit; PREFETCH / K_STAGES change no bit, and unit scales give the
    bf16 path's bits for the e4m3 values as bf16 weights (the same tile)."""
    r = _assert_case(results, case)
    assert r["unit_scale_equal"] if not {"F16", "X8"} & set(case[6] or {}) else "unit_scale_equal" not in r, r


def _assert_case(results, case) -> dict:
    """A case's result held to the bounds of ``test_matches_the_modules_prologue_times_w``; returns it."""
    name, prologue, N, K, has_res, has_out, cfg, _, M = case
    r = results[name]
    assert r["shape"] == ([N] if M is None else [M, N]) and r["dtype"] == "torch.bfloat16"
    if prologue == "rmsnorm" and ((M or 1) > 1 or (cfg or {}).get("ROWS")):
        assert r["ulp_exact"] <= r["module_ulp_exact"] + DEFERRED_ULP, r
    else:
        assert r["ulp"] <= ULP_TOL, r
    if has_out:
        assert r["residual_equal"], r
    if (cfg or {}).get("PREFETCH") or (cfg or {}).get("K_STAGES"):
        assert r["prefetch_equal"], r
    return r


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=None), "a float8_e4m3fn w needs w_scale"),
    (dict(fp8=False), "w_scale is for a float8_e4m3fn w, not torch.bfloat16"),
    (dict(scale=torch.ones(1, 2)), r"w_scale is torch.float32 \[1, 2\]; fp8 w \[N=200, K=256\] wants float32 \[2, 2\]"),
    (dict(scale=torch.ones(2, 2).bfloat16()), r"w_scale is torch.bfloat16 \[2, 2\]"),
    (dict(config=dict(BLOCK_N=24, BLOCK_K=64)), "BLOCK_N=24 must divide 128"),
    (dict(rows=4, config=dict(BLOCK_N=48, BLOCK_K=64)), "BLOCK_N=48 must divide 128"),
    (dict(rows=4, config=dict(BLOCK_N=64, BLOCK_K=256, DOT=True, F16=True)), "F16 .*BLOCK_K=256"),
    (dict(rows=4, config=dict(BLOCK_N=64, BLOCK_K=64, DOT=True, F16=True), pre_k=256), "F16 .*pre_k=256"),
    (dict(rows=4, config=dict(BLOCK_N=32, BLOCK_K=64, DOT=False, F16=True)), "F16 .*DOT=False"),
    (dict(rows=4, fp8=False, scale=None, config=dict(BLOCK_N=64, BLOCK_K=64, DOT=True, F16=True)),
     "F16 .*weights torch.bfloat16"),
    (dict(rows=4, config=dict(BLOCK_N=64, BLOCK_K=64, DOT=True, F16=True, X8=True)),
     r"one at a time, got \['F16', 'X8'\]"),
    (dict(rows=4, config=dict(BLOCK_N=64, BLOCK_K=256, DOT=True, X8=True)), r"X8.*\['X8'\], DOT=True.*BLOCK_K=256"),
])
def test_fp8_bad_arguments_are_named(kwargs, match):
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    K, rows = 256, kwargs.pop("rows", None)
    w = torch.randn(200, K).to(torch.float8_e4m3fn if kwargs.pop("fp8", True) else torch.bfloat16)
    x = torch.randn(K).bfloat16() if rows is None else torch.randn(rows, K).bfloat16()
    with pytest.raises(ValueError, match=match):
        decode_gemv(x, w, w_scale=kwargs.pop("scale", torch.ones(2, 2)), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prologue="gelu"), "prologue 'gelu'"),
    (dict(x_size=200), r"x has shape \[200\]"),
    (dict(prologue="swiglu"), r"wants \[512\]"),
    (dict(rows=17), r"1 <= M <= 16"),
    (dict(prologue="rmsnorm"), "needs norm_weight"),
    (dict(residual=True, residual_out="alias"), "residual_out needs"),
    (dict(residual_out=True), "residual_out needs"),
    (dict(config=dict(BLOCK_N=8, BLOCK_K=96)), "multiple of BLOCK_K=96"),
    (dict(rows=4, config=dict(BLOCK_N=16, BLOCK_K=64), pre_k=32), "a multiple of BLOCK_K"),
    (dict(pdl=True), "pdl=True needs a CUDA GPU"),
    (dict(fp32=True), "x, w must be bfloat16"),
])
def test_bad_arguments_are_named(kwargs, match):
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    K = 256
    dtype = torch.float32 if kwargs.pop("fp32", False) else torch.bfloat16
    rows = kwargs.pop("rows", None)
    x = torch.randn(kwargs.pop("x_size", K)).to(dtype) if rows is None else torch.randn(rows, K).to(dtype)
    r = torch.randn(K).bfloat16() if kwargs.pop("residual", False) else None
    r_out = kwargs.pop("residual_out", None)
    r_out = r if r_out == "alias" else (torch.empty(K).bfloat16() if r_out else None)
    with pytest.raises(ValueError, match=match):
        decode_gemv(x, torch.randn(32, K).to(dtype), residual=r, residual_out=r_out, **kwargs)


def test_default_config_fits_k():
    """BLOCK_K is cut to a power of two dividing K; the measured Qwen3-8B tiles are returned as is."""
    from dspark_trt.plugins.kernels.decode_gemv import CONFIGS, config_for
    assert config_for(96, 1024 + 256)["BLOCK_K"] == 256
    assert config_for(64, 48)["BLOCK_K"] == 16
    assert config_for(6144, 4096) == CONFIGS[(6144, 4096)]


def test_rows_default_config_splits_k_for_the_sms():
    """Unmeasured few-token shapes: split K until >= 2 programs per SM while each split keeps >= 4
    K tiles; the tensor cores from 5 tokens."""
    from dspark_trt.plugins.kernels.decode_rows import default_config
    o = default_config(8, 4096, 4096, sms=132)                   # 64 tiles of 64 rows
    assert o["DOT"] and o["SPLIT_K"] == 8 and 64 * o["SPLIT_K"] >= 264
    assert default_config(8, 24576, 4096, sms=132)["SPLIT_K"] == 1   # 384 tiles already
    assert default_config(4, 4096, 1024, sms=132)["SPLIT_K"] == 1    # 1024 / 256: 4 K tiles, no more split
    assert not default_config(4, 4096, 4096)["DOT"]


def test_rows_tables_merge_and_route_one_token(tmp_path, monkeypatch):
    """``load_table`` merges sweeps (a later file's shape over an earlier's) and leaves the table as
    it was when a file is not a sweep's result, naming it; a one-token winner with ``ROWS`` sends
    one token to the rows kernel (as a row), without it to the one-token kernel's tile."""
    import json
    from dspark_trt.plugins.kernels import decode_gemv as dg, decode_rows
    monkeypatch.setattr(decode_rows, "CONFIGS", dict(decode_rows.CONFIGS))
    monkeypatch.setattr(decode_rows, "GPU_TABLES", True)          # load_table turns them off
    rows = lambda *r: {"rows": [dict(bucket=b, N=n, K=k, best_config=c) for b, n, k, c in r]}  # noqa: E731
    a, b, bad = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "bad.json"
    one = dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=2, DOT=False, ROWS=True)
    a.write_text(json.dumps(rows((8, 32, 256, dict(BLOCK_N=16, BLOCK_K=64)), (1, 32, 256, dict(BLOCK_N=4)))))
    b.write_text(json.dumps(rows((1, 32, 256, one))))
    bad.write_text(json.dumps({"shapes": []}))
    assert decode_rows.load_table(str(a), str(b)) == 2 and not decode_rows.GPU_TABLES
    assert decode_rows.CONFIGS == {(8, 32, 256): dict(BLOCK_N=16, BLOCK_K=64), (1, 32, 256): one}
    with pytest.raises(ValueError, match="bad.json"):
        decode_rows.load_table(str(a), str(bad))
    assert decode_rows.CONFIGS[(1, 32, 256)] == one
    seen = []
    monkeypatch.setattr(decode_rows, "decode_rows", lambda x, w, y, *a: seen.append((x.shape, y.shape, a[-3])))
    x, w = torch.randn(256).bfloat16(), torch.randn(32, 256).bfloat16()
    assert dg.decode_gemv(x, w).shape == (32,)
    assert seen == [((1, 256), (1, 32), one)]


H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
OTHER_GPU = "NVIDIA A100-SXM4-80GB"                       # no table ships for it
# the one-token winners of benchmarks/results/decode-rows-NVIDIA-H100-80GB-HBM3-cab3dea.json.gz (session 49, the
# sweep's wider space: through LLM at batch 1 the AR step 5.671 against 5.742 ms with 9985f8c's in the same call)
H100_ONE_TOKEN = {
    (1, 6144, 4096): dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 4096): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 24576, 4096): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 4096, 12288): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=3),
    (1, 151936, 4096): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3),
}
# the eight-token winners of decode-rows-NVIDIA-H100-80GB-HBM3-9f4de0e-dirty.json.gz (session 49, cab3dea's tree on
# the same warm H100: the verify 6.543 against 6.681 ms, the draft block 1.439 against 1.479)
H100_EIGHT_TOKENS = {
    (8, 6144, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, DOT=True, num_warps=4, num_stages=3),
    (8, 4096, 4096): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, DOT=True, num_warps=4, num_stages=3),
    (8, 24576, 4096): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=3),
    (8, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, DOT=True, num_warps=4, num_stages=2),
    (8, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
}

# the winners on fp8 weights of decode-rows-fp8-NVIDIA-H100-80GB-HBM3-5036286.json.gz (8 and 16 tokens: the F16 and
# X8 tiles) and -2e3bbab.json.gz (one token). Session 58, through LLM at batch 1 on one H100: the fp8 chain's verify
# 4.916 against 7.994 ms with the table's bf16 tiles (AR 3.906 / 3.901), batch-16 AR 4.623 against 6.318; with
# the one-token rows too, AR 3.606 ms (68 % of the fp8 bytes' 2.45 ms), verify 4.969
H100_FP8_TILES = {
    (1, 6144, 4096, 1): dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 4096, 1): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 24576, 4096, 1): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 12288, 1): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=8, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (8, 6144, 4096, 1): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3, F16=True),
    (8, 4096, 4096, 1): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3, F16=True),
    (8, 24576, 4096, 1): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, DOT=True, num_warps=8, num_stages=3, X8=True),
    (8, 4096, 12288, 1): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, DOT=True, num_warps=8, num_stages=3, X8=True),
    (16, 6144, 4096, 1): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=8, num_stages=3, F16=True),
    (16, 4096, 4096, 1): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, DOT=True, num_warps=4, num_stages=3, F16=True),
    (16, 24576, 4096, 1): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, DOT=True, num_warps=8, num_stages=3, X8=True),
    (16, 4096, 12288, 1): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, DOT=True, num_warps=8, num_stages=3, X8=True),
}


@pytest.fixture
def gpu_tables(monkeypatch):
    """decode_rows with the per-GPU tables on, none read yet, the built-in table restored after;
    ``gpu_tables(name)`` fakes every device as a CUDA GPU of that name."""
    from dspark_trt.plugins.kernels import decode_rows
    monkeypatch.setattr(decode_rows, "CONFIGS", dict(decode_rows.CONFIGS))
    monkeypatch.setattr(decode_rows, "GPU_TABLES", True)
    monkeypatch.setattr(decode_rows, "_gpu_tables", {})
    return lambda name: monkeypatch.setattr(decode_rows, "gpu_name", lambda device: name)


def test_shipped_h100_table_holds_the_measured_tiles(tmp_path):
    """The H100's table ships as package data: the Qwen3-8B winners of its sweep of every bucket
    (9985f8c), its one- and eight-token rows since replaced by session 49's sweeps (``--keep``), then
    beside them fp8 weights' winners for 8 and 16 tokens (5036286) and one token (2e3bbab), each
    step's provenance kept; rebuilt from those results where they exist, it is the same file."""
    import json
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path
    from dspark_trt.plugins.kernels import decode_rows
    path = decode_rows.table_path(H100)
    assert path.name == "decode-rows-NVIDIA-H100-80GB-HBM3.json" and path.parent == decode_rows.TABLES
    table = decode_rows.read_table(path)
    assert {k: v for k, v in table.items() if k[0] == 1 and len(k) == 3} == H100_ONE_TOKEN
    assert {k: v for k, v in table.items() if k[0] == 8 and len(k) == 3} == H100_EIGHT_TOKENS
    assert {k: v for k, v in table.items() if len(k) == 4} == H100_FP8_TILES
    assert sorted({k[0] for k in table}) == [1, 2, 4, 8, 16] and len(table) == 25 + 12
    doc = json.loads(path.read_text())
    steps = [doc]
    while "kept_from" in steps[-1]:
        steps.append(steps[-1]["kept_from"])                                      # newest first
    assert [(d["gpu"], d["git_sha"], d.get("buckets")) for d in steps] == [
        (H100, "2e3bbab", [1]), (H100, "5036286", [8, 16]),
        (H100, "9f4de0e-dirty", [8]), (H100, "cab3dea", [1]), (H100, "9985f8c", None)]
    assert [d["kept_buckets"] for d in steps[:4]] == [[1, 2, 4, 8, 16]] * 2 + [[1, 2, 4, 16], [2, 4, 8, 16]]
    assert all("--fp8" in d["command"] for d in steps[:2]) and not any("--fp8" in d["command"] for d in steps[2:])
    assert steps[4]["command"].startswith("python benchmarks/decode_rows_sweep.py --rows 1,2,4,8,16")
    package = Path(decode_rows.__file__).parents[2]                      # dspark_trt/
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["dspark_trt"]
    assert any(fnmatch(str(path.relative_to(package)), pattern) for pattern in data)
    results = [package.parent / "benchmarks" / "results" / d["source"] for d in reversed(steps)]
    if all(r.exists() for r in results):                 # the table is those results, shipped in order
        for r, d in zip(results, reversed(steps)):
            rebuilt = decode_rows.ship_table(r, tmp_path, d.get("buckets"), keep=True)
        assert rebuilt.read_text() == path.read_text()


# the winners of benchmarks/results/decode-rows-NVIDIA-H200-61d9ae4.json.gz for one and eight tokens (session 48:
# through LLM at batch 1 the AR step 4.303 against 4.616 ms with the built-in tiles, the verify 5.006 against 5.183)
H200_TILES = {
    (1, 6144, 4096): dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 4096): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 24576, 4096): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 4096, 12288): dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 151936, 4096): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),
    (8, 6144, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (8, 4096, 4096): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, DOT=True, num_warps=4, num_stages=4),
    (8, 24576, 4096): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, DOT=True, num_warps=8, num_stages=3),
    (8, 4096, 12288): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=4),
    (8, 151936, 4096): dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=8, num_stages=4),
}
# the winners on fp8 weights of decode-rows-fp8-NVIDIA-H200-165cdb5.json.gz (session 57: through LLM at batch 1
# the fp8 chain's AR step 2.857 against 3.352 ms, the verify 6.543 against 9.246, with the bf16 tiles in the same call)
H200_FP8_TILES = {
    (1, 6144, 4096, 1): dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 4096, 1): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),
    (1, 24576, 4096, 1): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (1, 4096, 12288, 1): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=8, DOT=False, num_warps=4, num_stages=3, ROWS=True),
    (8, 6144, 4096, 1): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (8, 4096, 4096, 1): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, DOT=True, num_warps=4, num_stages=3),
    (8, 24576, 4096, 1): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, DOT=True, num_warps=4, num_stages=3),
    (8, 4096, 12288, 1): dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=16, DOT=True, num_warps=4, num_stages=3),
}


def test_shipped_h200_table_holds_the_measured_tiles(gpu_tables, tmp_path):
    """The H200's table ships the Qwen3-8B winners of its sweeps for one and eight tokens only (the AR
    step, a verify block, the draft block at batch 1): bf16 weights (61d9ae4), then beside them fp8
    weights' (165cdb5, kept over the bf16 rows), with where they came from; on an H200 the other token
    counts keep the built-in tiles, which were measured on an H200."""
    import json
    from pathlib import Path
    from dspark_trt.plugins.kernels import decode_rows
    path = decode_rows.table_path(H200)
    assert decode_rows.read_table(path) == {**H200_TILES, **H200_FP8_TILES}
    doc = json.loads(path.read_text())
    steps = [doc, doc["kept_from"]]                                            # newest first
    assert [(d["gpu"], d["git_sha"], d["buckets"]) for d in steps] == [(H200, "165cdb5", [1, 8]),
                                                                      (H200, "61d9ae4", [1, 8])]
    assert "--fp8" in doc["command"] and "--fp8" not in steps[1]["command"]
    results = [Path(decode_rows.__file__).parents[3] / "benchmarks" / "results" / d["source"] for d in reversed(steps)]
    if all(r.exists() for r in results):                 # the table is those results' buckets 1 and 8, in order
        decode_rows.ship_table(results[0], tmp_path, buckets={1, 8})
        assert decode_rows.ship_table(results[1], tmp_path, buckets={1, 8}, keep=True).read_text() == path.read_text()
    gpu_tables(H200)
    assert decode_rows.tile_for(7, 4096, 12288, "cuda") == H200_TILES[(8, 4096, 12288)]        # a draft block
    assert decode_rows.tile_for(7, 4096, 12288, "cuda", fp8=True) == H200_FP8_TILES[(8, 4096, 12288, 1)]
    assert decode_rows.tile_for(4, 24576, 4096, "cuda") == decode_rows.CONFIGS[(4, 24576, 4096)]
    assert decode_rows.tile_for(16, 6144, 4096, "cuda") == decode_rows.CONFIGS[(16, 6144, 4096)]
    assert decode_rows.tile_for(1, 151936, 4096, "cuda", fp8=True) == H200_TILES[(1, 151936, 4096)]  # no fp8 head


def test_tile_for_reads_the_gpus_own_table(gpu_tables, monkeypatch):
    """A CUDA device named as the H100 gets its table's tiles for its shapes (one and 16 tokens: not
    the built-in 16-token tile); another GPU's name, the built-in ones only; the table is read once;
    ``choose_config`` and ``decode_gemv``'s one-token path both take it."""
    from dspark_trt.plugins.kernels import decode_gemv as dg, decode_rows
    gpu_tables(H100)
    assert decode_rows.tile_for(1, 24576, 4096, "cuda") == H100_ONE_TOKEN[(1, 24576, 4096)]
    assert decode_rows.choose_config(1, 6144, 4096, "cuda") == H100_ONE_TOKEN[(1, 6144, 4096)]
    sixteen = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, DOT=True, num_warps=4, num_stages=3)
    assert decode_rows.tile_for(16, 24576, 4096, "cuda:1") == sixteen != decode_rows.CONFIGS[(16, 24576, 4096)]
    assert decode_rows.tile_for(1, 1000, 4096, "cuda") is None
    decode_rows.tile_for(1, 24576, 4096, "cuda")["BLOCK_N"] = 1                   # a copy
    assert decode_rows.tile_for(1, 24576, 4096, "cuda") == H100_ONE_TOKEN[(1, 24576, 4096)]
    assert list(decode_rows._gpu_tables) == [H100]
    gpu_tables(OTHER_GPU)
    assert decode_rows.tile_for(1, 24576, 4096, "cuda") is None
    assert decode_rows.tile_for(8, 24576, 4096, "cuda") == decode_rows.CONFIGS[(8, 24576, 4096)]
    assert decode_rows._gpu_tables[OTHER_GPU] == {}
    gpu_tables(H100)                                     # decode_gemv, one token: qkv's ROWS tile, o's
    seen = []

    class Launches:                                      # launcher(kernel)[grid](*args, **meta)
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(meta)

    monkeypatch.setattr(decode_rows, "decode_rows", lambda x, w, y, *a: seen.append(a[-3]))
    monkeypatch.setattr(dg, "launcher", lambda kernel: Launches())
    dg.decode_gemv(torch.empty(4096).bfloat16(), torch.empty(6144, 4096).bfloat16(), "rmsnorm",
                   norm_weight=torch.ones(4096).bfloat16())
    dg.decode_gemv(torch.empty(4096).bfloat16(), torch.empty(4096, 4096).bfloat16())
    assert seen[0] == H100_ONE_TOKEN[(1, 6144, 4096)]
    assert (seen[1]["BLOCK_N"], seen[1]["BLOCK_K"], seen[1]["num_warps"]) == (4, 1024, 4)
    assert dg.CONFIGS[(4096, 4096)]["BLOCK_N"] == 8                              # the built-in one-token tile


def test_cpu_devices_and_explicit_tables_keep_the_builtin_or_their_own(gpu_tables, tmp_path):
    """Off CUDA no GPU table is read; a table loaded explicitly (``load_table``, what
    ``DSPARK_DECODE_ROWS_TABLE`` does at import) replaces the built-in one and wins over the GPU's."""
    import json
    from dspark_trt.plugins.kernels import decode_rows
    assert decode_rows.gpu_name(torch.device("cpu")) is None
    assert decode_rows.tile_for(1, 24576, 4096, torch.device("cpu")) is None
    assert decode_rows.tile_for(8, 24576, 4096, "cpu") == decode_rows.CONFIGS[(8, 24576, 4096)]
    assert decode_rows._gpu_tables == {}
    gpu_tables(H100)
    mine = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4)
    env = tmp_path / "mine.json"
    env.write_text(json.dumps({"rows": [dict(bucket=1, N=4096, K=4096, best_config=mine)]}))
    decode_rows.load_table(str(env))
    assert decode_rows.tile_for(1, 4096, 4096, "cuda") == mine
    assert decode_rows.tile_for(1, 24576, 4096, "cuda") is None                 # not the H100's
    assert decode_rows.tile_for(8, 24576, 4096, "cuda") is None                 # replaced, as before


def test_env_table_wins_at_import_without_touching_cuda(tmp_path):
    """``DSPARK_DECODE_ROWS_TABLE`` at import: its table replaces the built-in one and the per-GPU
    tables stay off (a fake H100 gets the env's tiles); importing initialises no CUDA."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env_table = tmp_path / "env.json"
    env_table.write_text(json.dumps({"rows": [dict(bucket=1, N=4096, K=4096, best_config=dict(BLOCK_N=2))]}))
    code = (
        "import torch\n"
        "from dspark_trt.plugins.kernels import decode_gemv, decode_rows as d\n"
        "assert not torch.cuda.is_initialized()\n"
        f"d.gpu_name = lambda device: {H100!r}\n"
        "assert not d.GPU_TABLES and d.CONFIGS == {(1, 4096, 4096): dict(BLOCK_N=2)}\n"
        "assert d.tile_for(1, 4096, 4096, 'cuda') == dict(BLOCK_N=2)\n"
        "assert d.tile_for(1, 24576, 4096, 'cuda') is None and d._gpu_tables == {}\n")
    run_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run_env["DSPARK_DECODE_ROWS_TABLE"] = str(env_table)
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]


def test_bad_tables_are_named(gpu_tables, tmp_path, monkeypatch):
    """A shipped table that is not one, or is another GPU's, raises naming its file (on the first
    lookup for that GPU); so does ``ship_table`` given something other than a sweep's result."""
    import json
    from dspark_trt.plugins.kernels import decode_rows
    monkeypatch.setattr(decode_rows, "TABLES", tmp_path)
    gpu_tables("Fake GPU")
    (tmp_path / "decode-rows-Fake-GPU.json").write_text('{"rows": [{"bucket": 1, "N": 4')
    with pytest.raises(ValueError, match=r"decode-rows table '.*decode-rows-Fake-GPU\.json': not a"):
        decode_rows.tile_for(1, 4096, 4096, "cuda")
    (tmp_path / "decode-rows-Fake-GPU.json").write_text(json.dumps(
        {"gpu": "Other GPU", "rows": [dict(bucket=1, N=4096, K=4096, best_config=dict(BLOCK_N=2))]}))
    with pytest.raises(ValueError, match=r"decode-rows-Fake-GPU\.json': its gpu is not 'Fake GPU'"):
        decode_rows.tile_for(1, 4096, 4096, "cuda")
    bad = tmp_path / "bad-result.json"
    bad.write_text(json.dumps({"gpu": "Fake GPU", "shapes": []}))
    with pytest.raises(ValueError, match="bad-result.json"):
        decode_rows.ship_table(bad, tmp_path / "out")


def test_ship_table_keeps_keys_winners_and_provenance(tmp_path):
    """``ship_table``: a sweep's result (plain or gzipped) -> ``decode-rows-<gpu>.json`` holding the
    winners' keys and tiles (no timings) and the sweep's git sha, GPU, file name and command."""
    import gzip
    import json
    from dspark_trt.plugins.kernels import decode_rows
    tile = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3)
    doc = {"git_sha": "abc1234", "gpu": "Fake GPU 9", "command": "python benchmarks/decode_rows_sweep.py --rows 1",
           "rows": [dict(shape="o", N=4096, K=4096, M=1, bucket=1, best_config=tile, best_us=1.0, configs=[]),
                    dict(shape="x", N=64, K=64, M=1, bucket=1, best_config=None)]}
    src = tmp_path / "decode-rows-Fake-GPU-9-abc1234.json.gz"
    src.write_bytes(gzip.compress(json.dumps(doc).encode()))
    path = decode_rows.ship_table(src, tmp_path / "tables")
    assert path == tmp_path / "tables" / "decode-rows-Fake-GPU-9.json"
    shipped = json.loads(path.read_text())
    assert shipped == {"gpu": "Fake GPU 9", "git_sha": "abc1234", "source": src.name, "command": doc["command"],
                       "rows": [dict(shape="o", bucket=1, N=4096, K=4096, best_config=tile)]}
    assert decode_rows.read_table(path) == {(1, 4096, 4096): tile}
    doc["rows"].append(dict(shape="o", N=4096, K=4096, M=16, bucket=16, best_config=dict(tile, BLOCK_N=32)))
    src.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert decode_rows.read_table(decode_rows.ship_table(src, tmp_path / "all")) == {
        (1, 4096, 4096): tile, (16, 4096, 4096): dict(tile, BLOCK_N=32)}
    some = decode_rows.ship_table(src, tmp_path / "some", buckets=[1, 2])      # the others keep CONFIGS'
    assert decode_rows.read_table(some) == {(1, 4096, 4096): tile}
    assert json.loads(some.read_text())["buckets"] == [1, 2]


def test_ship_table_keep_replaces_only_its_buckets(tmp_path):
    """``ship_table(..., buckets, keep=True)`` over a GPU's table: the result's rows of those buckets
    replace the table's, the table's other rows stay (in shape order), and the table's head stays as
    ``kept_from`` (nested when kept twice); a table of another GPU is named, not merged."""
    import json
    from dspark_trt.plugins.kernels import decode_rows

    def result(sha, bn, buckets, gpu="Fake GPU 9"):
        rows = [dict(shape=s, N=n, K=4096, M=b, bucket=b, best_config=dict(BLOCK_N=bn, BLOCK_K=64))
                for s, n in (("qkv", 6144), ("o", 4096)) for b in buckets]
        path = tmp_path / f"decode-rows-{sha}.json"
        path.write_text(json.dumps({"git_sha": sha, "gpu": gpu, "command": f"sweep {sha}", "rows": rows}))
        return path

    out = tmp_path / "tables"
    decode_rows.ship_table(result("c0", 16, (1, 8, 16)), out)                 # every bucket of one sweep
    decode_rows.ship_table(result("a1", 32, (1, 16)), out, buckets=[1], keep=True)
    path = decode_rows.ship_table(result("b8", 64, (8,)), out, buckets=[8], keep=True)
    table = decode_rows.read_table(path)
    assert {k: v["BLOCK_N"] for k, v in table.items()} == {
        (1, 6144, 4096): 32, (8, 6144, 4096): 64, (16, 6144, 4096): 16,
        (1, 4096, 4096): 32, (8, 4096, 4096): 64, (16, 4096, 4096): 16}
    doc = json.loads(path.read_text())
    assert [(r["shape"], r["bucket"]) for r in doc["rows"]] == [
        ("qkv", 1), ("qkv", 8), ("qkv", 16), ("o", 1), ("o", 8), ("o", 16)]
    assert (doc["git_sha"], doc["buckets"], doc["kept_buckets"]) == ("b8", [8], [1, 16])
    kept = doc["kept_from"]
    assert (kept["git_sha"], kept["buckets"], kept["kept_buckets"]) == ("a1", [1], [8, 16])
    assert kept["kept_from"]["git_sha"] == "c0" and "buckets" not in kept["kept_from"]
    (out / "decode-rows-Fake-GPU-9.json").rename(out / "decode-rows-Other-GPU.json")
    other = json.loads((out / "decode-rows-Other-GPU.json").read_text())
    (out / "decode-rows-Other-GPU.json").write_text(json.dumps(dict(other, gpu="Fake GPU 9")))
    with pytest.raises(ValueError, match="decode-rows-Other-GPU.json.*its gpu is not 'Other GPU'"):
        decode_rows.ship_table(result("d1", 8, (1,), gpu="Other GPU"), out, buckets=[1], keep=True)


def test_fp8_tiles_ship_beside_the_bf16_ones_and_route_fp8_weights_only(tmp_path, monkeypatch, gpu_tables):
    """An fp8 sweep's rows (``weight_bytes`` 1) ship with ``keep`` beside the table's bf16 rows of the
    same buckets (neither replaces the other), and the GPU's table gives fp8 weights their own tile,
    bf16 weights theirs; fp8 shapes without one take the bf16 tile."""
    import json
    from dspark_trt.plugins.kernels import decode_rows

    def result(sha, bn, fp8):
        rows = [dict(shape="o", N=4096, K=4096, M=b, bucket=b, best_config=dict(BLOCK_N=bn, BLOCK_K=64),
                     **({"weight_bytes": 1} if fp8 else {})) for b in (1, 8)]
        path = tmp_path / f"decode-rows-{sha}.json"
        path.write_text(json.dumps({"git_sha": sha, "gpu": "Fake GPU 9", "command": "sweep", "rows": rows}))
        return path

    decode_rows.ship_table(result("bf", 16, False), tmp_path)
    path = decode_rows.ship_table(result("f8", 32, True), tmp_path, buckets=[1, 8], keep=True)
    assert {k: v["BLOCK_N"] for k, v in decode_rows.read_table(path).items()} == {
        (1, 4096, 4096): 16, (8, 4096, 4096): 16, (1, 4096, 4096, 1): 32, (8, 4096, 4096, 1): 32}
    assert decode_rows.ship_table(result("bf2", 64, False), tmp_path, buckets=[8], keep=True) == path
    assert decode_rows.read_table(path)[(1, 4096, 4096, 1)]["BLOCK_N"] == 32     # bf16 rows keep fp8 ones
    monkeypatch.setattr(decode_rows, "TABLES", tmp_path)
    gpu_tables("Fake GPU 9")
    cuda = torch.device("cuda")
    assert [decode_rows.tile_for(M, 4096, 4096, cuda, fp8)["BLOCK_N"] for M in (1, 8) for fp8 in (False, True)] \
        == [16, 32, 64, 32]
    monkeypatch.setattr(decode_rows, "CONFIGS", {})
    assert decode_rows.tile_for(1, 6144, 4096, cuda, fp8=True) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("pdl", [False, True])
def test_qwen3_8b_shapes_on_gpu(prologue, pdl):
    """Every Qwen3-8B projection shape with the GPU's one-token tile (its shipped table's, else the
    built-in one), with and without PDL: within one bf16 ulp (plus a little fp32 sum-order noise) of
    the modules' prologue times w (RMSNorm on a ``ROWS`` tile: the deferred scale, as
    ``test_qwen3_8b_rows_on_gpu``); PDL and ``PREFETCH`` change no bit."""
    from dspark_trt.plugins.kernels import decode_rows
    from dspark_trt.plugins.kernels.decode_gemv import CONFIGS, decode_gemv
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    torch.manual_seed(0)
    for N, K in CONFIGS:
        x = torch.randn(2 * K if prologue == "swiglu" else K, device="cuda").bfloat16()
        w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
        r = torch.randn(K, device="cuda").bfloat16() if prologue != "swiglu" else None
        g = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16() if prologue == "rmsnorm" else None
        r_out = torch.empty(K, device="cuda").bfloat16() if r is not None else None
        y = decode_gemv(x, w, prologue, residual=r, norm_weight=g, residual_out=r_out, pdl=pdl)
        xin, h = reference(prologue, x, r, g)
        if prologue == "rmsnorm" and (decode_rows.tile_for(1, N, K, x.device) or {}).get("ROWS"):
            exact = reference(prologue, h.float(), None, g.float())[0] @ w.float().T
            assert ulp_err(y, exact) <= ulp_err(torch.nn.functional.linear(xin, w), exact) + 1.0, (N, K)
        else:
            ref = xin.float() @ w.float().T
            ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp(min=1.0))) - 7)
            assert float(((y.float() - ref).abs() / ulp).max()) <= 0.75, (N, K)
        if r_out is not None:
            assert torch.equal(r_out, h)
        if pdl:
            assert torch.equal(y, decode_gemv(x, w, prologue, residual=r, norm_weight=g))
        else:
            from dspark_trt.plugins.kernels.decode_gemv import config_for
            tile = decode_rows.tile_for(1, N, K, x.device) or config_for(N, K)
            for extra in (dict(PREFETCH=True), dict(K_STAGES=3, PREFETCH=False)):
                assert torch.equal(y, decode_gemv(x, w, prologue, residual=r, norm_weight=g,
                                                  config={**tile, **extra})), (N, K, extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
def test_qwen3_8b_rows_on_gpu(prologue, rows):
    """A few tokens at every Qwen3-8B projection shape with the chosen tiles (split K, ticket
    reduction; one token: the rows kernel's default tile, ``ROWS``): within 1 ulp of the modules'
    prologue times w (RMSNorm: of the fp32 prologue's product, one ulp more than the modules' own
    result), residual sums bit for bit, PDL and a second call (the tickets reset) give the same bits."""
    from dspark_trt.plugins.kernels import decode_rows
    from dspark_trt.plugins.kernels.decode_gemv import CONFIGS, decode_gemv as gemv
    torch.manual_seed(rows)
    for N, K in CONFIGS:
        cfg = dict(decode_rows.default_config(1, N, K), ROWS=True) if rows == 1 else None
        decode_gemv = functools.partial(gemv, config=cfg)
        x = torch.randn(rows, 2 * K if prologue == "swiglu" else K, device="cuda").bfloat16()
        w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
        r = torch.randn(rows, K, device="cuda").bfloat16() if prologue != "swiglu" else None
        g = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16() if prologue == "rmsnorm" else None
        r_out = torch.empty(rows, K, device="cuda").bfloat16() if r is not None else None
        y = decode_gemv(x, w, prologue, residual=r, norm_weight=g, residual_out=r_out)
        xin, h = reference(prologue, x, r, g)
        if prologue == "rmsnorm":
            exact = reference(prologue, h.float(), None, g.float())[0] @ w.float().T
            assert ulp_err(y, exact) <= ulp_err(torch.nn.functional.linear(xin, w), exact) + 1.0, (N, K)
        else:
            assert ulp_err(y, xin.float() @ w.float().T) <= 1.0, (N, K)
        if r_out is not None:
            assert torch.equal(r_out, h)
        assert torch.equal(y, decode_gemv(x, w, prologue, residual=r, norm_weight=g))
        if torch.cuda.get_device_capability()[0] >= 9:
            assert torch.equal(y, decode_gemv(x, w, prologue, residual=r, norm_weight=g, pdl=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tile", ["one_token", "one_token_rows", "rows8", "rows8_F16", "rows8_X8"])
def test_qwen3_8b_fp8_on_gpu(tile):
    """Qwen3-8B's projections with fp8 weights (``quantize_fp8`` of bf16 weights, as the FP8 checkpoints
    are made) and their layer's prologue (q/k/v and gate/up RMSNorm after the residual sum, o the
    residual sum, down SwiGLU): one token on the GPU's one-token tile and on the rows kernel's default
    ``ROWS`` tile, eight tokens on the chosen tiles (the tensor cores, which round each scaled activation
    to bf16) and on a 128 x 64 tile with the F16 or X8 option (fp16 operands; the fp8 tensor cores, whose
    sums are added into fp32 every 32 columns): within one ulp more than the modules' fp8 reference (``fp8_linear_ref``: each weight
    dequantised to bf16) of the fp32 prologue times the fp32 dequantised weight; residual sums bit for
    bit; a second call (the tickets reset) and PDL give the same bits."""
    import torch.nn.functional as F
    from dspark_trt.plugins.fp8_linear import dequantize_fp8, quantize_fp8
    from dspark_trt.plugins.kernels import decode_rows
    from dspark_trt.plugins.kernels.decode_gemv import decode_gemv
    torch.manual_seed(0)
    rows = 8 if tile.startswith("rows8") else 1
    option = tile.split("_")[1] if tile.startswith("rows8_") else None
    for (N, K), prologue in {(6144, 4096): "rmsnorm", (4096, 4096): "none", (24576, 4096): "rmsnorm",
                             (4096, 12288): "swiglu"}.items():
        cfg = dict(decode_rows.default_config(1, N, K), ROWS=True) if tile == "one_token_rows" else None
        if option:
            cfg = {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 4, "DOT": True, "num_warps": 4, "num_stages": 3,
                   option: True}
        shape = (K,) if tile == "one_token" else (rows, K)
        x = torch.randn(*shape[:-1], 2 * K if prologue == "swiglu" else K, device="cuda").bfloat16()
        wq, s = quantize_fp8((torch.randn(N, K, device="cuda") * 0.02).bfloat16())
        r = torch.randn(shape, device="cuda").bfloat16() if prologue != "swiglu" else None
        g = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16() if prologue == "rmsnorm" else None
        r_out = torch.empty(shape, device="cuda").bfloat16() if r is not None else None
        gemv = functools.partial(decode_gemv, w=wq, prologue=prologue, residual=r, norm_weight=g, config=cfg, w_scale=s)
        y = gemv(x, residual_out=r_out)
        xin, h = reference(prologue, x, r, g)
        exact = (reference(prologue, h.float(), None, g.float())[0] if prologue == "rmsnorm" else xin.float()) \
            @ dequantize_fp8(wq, s, torch.float32).T
        module = F.linear(xin, dequantize_fp8(wq, s, torch.bfloat16))
        assert ulp_err(y, exact) <= ulp_err(module, exact) + 1.0, (N, K, ulp_err(y, exact), ulp_err(module, exact))
        if r_out is not None:
            assert torch.equal(r_out, h)
        assert torch.equal(y, gemv(x))
        if torch.cuda.get_device_capability()[0] >= 9:
            assert torch.equal(y, gemv(x, pdl=True))


def test_fp8_sweep_times_each_tensor_core_tile_on_fp16_and_e4m3_operands_too(monkeypatch):
    """``decode_rows_sweep.py --fp8`` adds ``F16`` to every tensor-core tile whose BLOCK_K divides 128
    (the options' rule), and ``X8`` to those of them with 128 rows, and to nothing else; a bf16
    sweep's tiles have neither."""
    from benchmarks import decode_rows_sweep as sweep
    bf16 = sweep.candidates(8, 4096, 12288)
    assert not any(c.get("F16") or c.get("X8") for c in bf16)
    monkeypatch.setattr(sweep, "FP8", True)
    fp8 = sweep.candidates(8, 4096, 12288)
    assert [c for c in fp8 if not (c.get("F16") or c.get("X8"))] == bf16
    fits = [c for c in bf16 if c.get("DOT") and 128 % c["BLOCK_K"] == 0]
    assert [c for c in fp8 if c.get("F16")] == [dict(c, F16=True) for c in fits]
    assert [c for c in fp8 if c.get("X8")] == [dict(c, X8=True) for c in fits if c["BLOCK_N"] >= 128]
    assert 0 < len(fits) < len(bf16) and any(c["BLOCK_N"] == 128 for c in fits)   # 64 x 256 has no twin
