"""benchmarks/plot_moe_mxfp4.py: % of HBM per model and series in token order, each variant from
the first file that has it (failed variants, without ``pct``, skipped), and a PNG."""
from __future__ import annotations

import json
import sys

import pytest

from tests.support.benchmark_scripts import load_benchmark

pm = load_benchmark("plot_moe_mxfp4")


def _doc(sha: str, rows: list[tuple[str, int, dict]]) -> dict:
    return {"git_sha": sha, "gpu": "G", "peak_bytes_per_s": 3.35e12, "shapes": {"flash": {"d": 8, "h": 4, "k": 2}},
            "rows": [{"model": m, "M": M, **variants} for m, M, variants in rows]}


def test_curves_first_file_wins_and_failures_are_skipped():
    new = _doc("b", [("flash", 16, {"mxfp4_gemv_e4m3": {"pct": 60.0}, "mxfp4_gemv_mma": {"error": "x"}}),
                     ("flash", 1, {"mxfp4_gemv_e4m3": {"pct": 40.0}, "bf16": {"pct": 50.0}})])
    old = _doc("a", [("flash", 1, {"mxfp4_gemv_e4m3": {"pct": 10.0}, "mxfp4_gemv_mma": {"pct": 23.0}}),
                     ("pro", 1, {"bf16_gemv": {"pct": 80.0}, "unknown": {"pct": 1.0}})])
    assert pm.curves([new, old]) == {
        "flash": {"MXFP4 GEMV, e4m3 (default)": [(1, 40.0), (16, 60.0)], "bf16 grouped": [(1, 50.0)],
                  "MXFP4 tensor-core GEMV (dropped)": [(1, 23.0)]},
        "pro": {"bf16 GEMV": [(1, 80.0)]}}


def test_before_adds_the_earlier_default_as_its_own_series():
    now = _doc("b", [("flash", 1, {"mxfp4_gemv_e4m3": {"pct": 52.0}, "mxfp4_gemv": {"pct": 52.0}})])
    before = _doc("a", [("flash", 4, {"mxfp4_gemv": {"pct": 50.0}}), ("flash", 1, {"mxfp4_gemv": {"pct": 40.0}})])
    assert pm.curves([now], before) == {"flash": {"MXFP4 GEMV, e4m3 (default)": [(1, 52.0)],
                                                  "MXFP4 GEMV at a": [(1, 40.0), (4, 50.0)]}}


def test_main_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_doc("a", [("flash", 1, {"mxfp4_gemv_e4m3": {"pct": 40.0}}),
                                          ("flash", 4, {"mxfp4_gemv_e4m3": {"pct": 55.0}})])))
    out = tmp_path / "x.png"
    argv, sys.argv = sys.argv, ["plot", str(path), "--before", str(path), "--out", str(out)]
    try:
        pm.main()
    finally:
        sys.argv = argv
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
