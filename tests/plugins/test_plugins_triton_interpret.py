"""Triton kernels vs references on CPU through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernels run in subprocesses
(the variable never reaches this process or other tests): two background jobs
(tests/support/prebuilt.py, started with the session) run halves of ``plugins_cases.SECTIONS`` and
report numbers; each test asserts on its op's numbers.
Tolerances: fp32 inputs, so 1e-5 absolute (sum order differs from torch); tokens and indices exact.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.support import prebuilt
from tests.support.plugins_cases import SECTIONS, write_results

pytest.importorskip("triton", reason="Triton is not installed")

# the interpreter runs every program of a grid one after another: two halves of about equal time
HALVES = [["tuner_markov", "tuner_sparse_mla", "kv_cache", "swa_and_mla", "moe"],
          ["block_attention", "markov", "rejection", "tuner_rejection", "tuner_block_attention"]]
assert sorted(HALVES[0] + HALVES[1]) == sorted(SECTIONS)
JOBS = [prebuilt.job(f"triton-interpret-{i + 1}", write_results, args=(half,), fixture="results", timeout=900,
                     env={"TRITON_INTERPRET": "1"}) for i, half in enumerate(HALVES)]


@pytest.fixture(scope="module")
def results() -> dict:
    out: dict = {}
    for job in JOBS:
        for case, r in json.loads((job.wait() / "results.json").read_text()).items():
            if case == "tuner_configs" and case in out:
                out[case] = {k: out[case][k] + r[k] for k in r}
            else:
                assert case not in out, case
                out[case] = r
    return out


def test_interpreter_did_not_leak():
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"


def test_kv_cache_write_kernel(results):
    r = results["kv_cache_write"]
    assert r["err"] == 0.0 and r["pad_page_untouched"]


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("variant", ["", "_prefetch", "_kvh_first", "_ticket"])
@pytest.mark.parametrize("mask", ["causal", "block"])
def test_block_attention_kernel(results, mask, variant, splits):
    assert results[f"block_attention_{mask}{variant}_split{splits}"]["err"] < 1e-5


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("reduce", ["two_pass", "ticket"])
@pytest.mark.parametrize("mask", ["causal", "block"])
def test_block_attention_kernel_indexed_queries(results, mask, reduce, splits):
    """Packed query rows named by ``q_index`` (the packed verify's slots grouped by row): each
    named row gets its window token's attention, rows no token names stay zero."""
    r = results[f"block_attention_{mask}_indexed_{reduce}_split{splits}"]
    assert r["shape"] and r["err"] < 1e-5


@pytest.mark.parametrize("mask", ["causal", "block"])
def test_block_attention_ticket_reuses_counters(results, mask):
    r = results[f"block_attention_{mask}_ticket_again"]
    assert r["equal"] and r["counters_zero"]


@pytest.mark.parametrize("schedule", ["one", "per_step", "prologue", "dot_snake", "gemv", "gemv_b1", "gemv_ticket",
                                      "one_gemv", "one_gemv_pipeline", "gemv_ticket_pipeline",
                                      "gemv_b1_pipeline", "one_unpacked",
                                      "one_gemv_b1_sampled", "all_greedy_one", "all_greedy_per_step", "z_out",
                                      "per_step_groups", "prologue_groups", "rows", "aot", "topk", "topk_wide",
                                      "draft_vocab_one", "draft_vocab_per_step", "draft_vocab_gemv",
                                      "draft_vocab_topk"])
def test_markov_sample_kernel(results, schedule):
    r = results[f"markov_sample_{schedule}"]
    assert r["tokens_equal"] and r["err"] < 1e-5


def test_markov_packed_argmax_is_torch_argmax(results):
    assert results["markov_packed_argmax"]["tokens_equal"]


@pytest.mark.parametrize("case", ["rejection_sample", "rejection_sample_row", "rejection_sample_split",
                                  "rejection_sample_many", "rejection_sample_topp", "rejection_sample_topp_row"])
def test_rejection_sample_kernel(results, case):
    r = results[case]
    assert r["tokens_equal"]
    assert len(set(r["accepted"])) > 1          # the case mixes accepted lengths


def test_rejection_sample_bonus_only(results):
    """N = 0: nothing to verify, the bonus token is sampled from p."""
    r = results["rejection_sample_bonus_only"]
    assert r["tokens_equal"] and set(r["accepted"]) == {0}


@pytest.mark.parametrize("case", ["sample_tokens", "sample_tokens_split", "sample_tokens_bf16", "sample_tokens_masked"])
def test_sample_tokens_kernel(results, case):
    """One token per row (the AR step, the prefill's first token) equals the torch reference; greedy
    rows are the argmax and the noise moves some sampled row off it (the case samples)."""
    r = results[case]
    assert r["tokens_equal"]
    assert all(t == a for t, a, g in zip(r["tokens"], r["argmax"], r["greedy"]) if g)
    assert any(t != a for t, a, g in zip(r["tokens"], r["argmax"], r["greedy"]) if not g)


@pytest.mark.parametrize("case", [f"rows_finite_{d}_{s}" for d in ("fp32", "bf16") for s in (None, 1, 3)])
def test_rows_finite_kernel(results, case):
    """Rows with a NaN, a +Inf or a -Inf (at a slice's first or last column) are flagged, the
    others not, as the torch reference."""
    r = results[case]
    assert r["equal"] and r["bool"] and r["flags"] == [True, False, False, True, False]


def test_noncausal_swa_indices_kernel(results):
    assert results["noncausal_swa_indices"]["tokens_equal"]


@pytest.mark.parametrize("case", ["sparse_mla_attention", "sparse_mla_attention_split",
                                  "sparse_mla_attention_dv_tiles", "sparse_mla_attention_dv_eq_d",
                                  "sparse_mla_attention_padded", "sparse_mla_attention_padded_split",
                                  "sparse_mla_attention_no_prefetch", "sparse_mla_attention_no_prefetch_split",
                                  "sparse_mla_attention_group2", "sparse_mla_attention_group4_masked_heads"])
def test_sparse_mla_attention_kernel(results, case):
    assert results[case]["err"] < 1e-5


@pytest.mark.parametrize("case", ["moe_experts", "moe_experts_blocks", "moe_experts_int32_ids", "moe_experts_aot",
                                  "moe_experts_decode", "moe_experts_decode_tiles",
                                  "moe_experts_decode_stages"])
def test_moe_experts_kernel(results, case):
    assert results[case]["err"] < 1e-5


def test_tuner_candidate_configs(results):
    """benchmarks/tune_plugins.py's candidates all launch and match the reference (so GPU time is
    not spent on a config that cannot work)."""
    r = results["tuner_configs"]
    assert r["checked"] == r["distinct"] >= 40 and not r["failures"], r["failures"]
