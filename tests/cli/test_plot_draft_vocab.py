"""benchmarks/plot_draft_vocab.py: decode_paths JSONs grouped by batch and set size (the full
vocabulary from ``eager_chain``), taus per temperature in size order, and a PNG from both."""
from __future__ import annotations

import json

import pytest

from tests.support.benchmark_scripts import load_benchmark

pv = load_benchmark("plot_draft_vocab")


def _paths(size: int, ms: float, with_full: bool) -> dict:
    rows = {"1": {"draft_step_ms": ms, "draft_roofline_ms": ms / 2}, "16": {"draft_step_ms": 2 * ms,
                                                                        "draft_roofline_ms": ms}}
    paths = {"eager_chain_vocab": {"batch": rows}, "eager_fused": {"batch": {"1": {"draft_step_ms": 9.0}}}}
    if with_full:
        paths["eager_chain"] = {"batch": {"1": {"draft_step_ms": 1.4, "draft_roofline_ms": 1.0}}}
    return {"paths": paths, "shapes": {"draft_vocab_size": size}, "gpu": "G", "git_sha": "s", "vocab_size": 100}


def test_draft_steps_by_batch_and_size_first_file_wins():
    got = pv.draft_steps([_paths(32, 1.0, True), _paths(16, 0.9, False), _paths(32, 5.0, True)])
    assert {B: {s: r["draft_step_ms"] for s, r in v.items()} for B, v in got.items()} == {
        1: {100: 1.4, 32: 1.0, 16: 0.9}, 16: {32: 2.0, 16: 1.8}}        # eager_fused ignored


def test_taus_sorted_by_size_per_temperature(tmp_path):
    acc = {"model": "m", "vocab_size": 100, "device": "cpu", "git_sha": "s",
           "sizes": {"100": {"corpus_coverage": 1.0, "T=0": {"tau": 2.2, "tau_ci95": 0.1}},
                     "25": {"corpus_coverage": 0.8, "T=0": {"tau": 1.9, "tau_ci95": 0.2}}}}
    assert pv.taus(acc) == {"T=0": [(25, 1.9, 0.2), (100, 2.2, 0.1)]}
    pytest.importorskip("matplotlib")
    (tmp_path / "p.json").write_text(json.dumps(_paths(32, 1.0, True)))
    (tmp_path / "a.json").write_text(json.dumps(acc))
    import sys
    out = tmp_path / "x.png"
    argv, sys.argv = sys.argv, ["plot", "--paths", str(tmp_path / "p.json"), "--vocab-size", "100",
                                "--acceptance", str(tmp_path / "a.json"), "--out", str(out)]
    try:
        pv.main()
    finally:
        sys.argv = argv
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
