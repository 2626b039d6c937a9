"""The one-token kernel chain of ``runtime/token_step.py`` (issue #21): under the Triton
interpreter against the module's own decode step, its refusals, and on a GPU at Qwen3-8B layer
dims with and without programmatic dependent launch."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from tests.support import prebuilt  # noqa: E402
from tests.support.skinny_gemm_cases import ulp_err  # noqa: E402
from tests.support.token_step_cases import (CASES, DEEP_CASES, DEFAULT_DIMS_CASES, DRAFT_CASES,  # noqa: E402
                                            DRAFT_CONTEXT_ROW_CASE, DRAFT_ROW_CASE, FP8_CASES, ROW_CASES,
                                            write_results)

STEPS = prebuilt.job("token-step-cases", write_results, args=("steps",), fixture="results", timeout=900,
                     env={"TRITON_INTERPRET": "1"})
LLM_RUNS = prebuilt.job("token-step-llm", write_results, args=("llm",), fixture="llm_runs", timeout=900,
                        env={"TRITON_INTERPRET": "1"})
LOGIT_TOL = 0.02     # of the logits' scale: bf16 GEMV outputs summed in another order than torch's
DEEP_RATIO = 1.25    # chain / module error against fp32 after 12 layers (test_chain_drifts_...)
ULP_TOL = 4.0        # K / V and taps in bf16 ulps: each GEMV's output may round the other way
                     # (fp32 sums in another order), and later layers inherit those differences


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((STEPS.wait() / "results.json").read_text())


@pytest.fixture(scope="module")
def llm_runs() -> dict:
    return json.loads((LLM_RUNS.wait() / "results.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chain_equals_the_modules_decode_step(results, case):
    """One token, a verify block, two rows (one with a padding token): the live tokens' logits
    within LOGIT_TOL of the module step's with the same argmax, the taps of the chosen layers and
    the step's K / V rows in every layer within ULP_TOL bf16 ulps (a missing residual, norm or
    RoPE is off by orders of magnitude), no other cache row touched (the padding token writes
    none)."""
    name, _, _, _, prompts, T, padded = case
    r = results[name]
    assert r["logits_dtype"] == "torch.bfloat16" and r["shape"] == r["ref_shape"]
    assert r["rows_written"] == len(prompts) * T - padded
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["taps_shape"] == r["ref_taps_shape"] and r["taps_ulp"] <= ULP_TOL, r
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


@pytest.mark.parametrize("case", DEFAULT_DIMS_CASES, ids=[c[0] for c in DEFAULT_DIMS_CASES])
def test_chain_at_the_default_pairs_dims(results, case):
    """The default pair's target layer dims (d 512, 8 / 4 heads of 64, an MLP of 1408 = 11 x 128,
    a tied head; the chain is ``LLM``'s default on a GPU, so ``dspark-trt generate`` runs it): one
    token and a verify block of 8 within LOGIT_TOL of the module step, same argmax, K / V within
    ULP_TOL ulps, nothing else in the cache touched."""
    name, T = case
    r = results[name]
    assert r["rows_written"] == T and r["shape"] == r["ref_shape"]
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_chain_on_fp8_projections_equals_the_fp8_modules(results, case):
    """Weight-only fp8 projections (``--quantization fp8``: e4m3 codes, 128x128 block scales, read
    as such by the chain's GEMVs, the scale folded into the activations), fused and unfused: one
    token and a verify block of 8 within LOGIT_TOL of the fp8 modules' step (which dequantise to
    bf16) with the same argmax, K / V within ULP_TOL ulps, nothing else in the cache touched. A
    scale taken from the wrong block, or none, is off by the blocks' ratio (the cases' blocks differ
    by up to 8x in magnitude)."""
    r = results[case[0]]
    assert r["rows_written"] == case[2] and r["shape"] == r["ref_shape"]
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["taps_ulp"] <= ULP_TOL and r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


@pytest.mark.parametrize("case", DEEP_CASES, ids=[c[0] for c in DEEP_CASES])
def test_chain_drifts_from_fp32_no_more_than_the_modules(results, case):
    """12 layers (weights x 4), one token and a verify block of 8 (the few-token GEMV with its
    deferred norm scale): the chain's logits are as close to the same step in fp32 as the modules'
    (within DEEP_RATIO of their error; measured 0.0068 / 0.0069 and 0.0077 / 0.0073 of the scale).
    A chain that rounds one more time drifts further: the few-token GEMV's sums rounded to bf16
    before the deferred norm scale gave 0.0104 (1.42x)."""
    r = results[case[0]]
    assert r["chain_fp32_err"] <= DEEP_RATIO * r["module_fp32_err"], r


@pytest.mark.parametrize("case", DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_draft_chain_equals_the_modules_block_pass(results, case):
    """The DSpark draft's block (the anchor, then mask tokens, non-causal), one row and two rows
    with an inert one: the live rows' base logits within LOGIT_TOL of the module's with the same
    argmax, the block's K / V in every draft layer within ULP_TOL ulps, no other cache row touched
    (the inert row writes none); with a confidence head, the drafts and confidence logits of
    ``forward(with_confidence=True)``."""
    name, ctx, N = case
    r = results[name]
    assert r["shape"] == r["ref_shape"] and r["rows_written"] == N * sum(n > 0 for n in ctx)
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r
    # with the confidence head: the same greedy drafts, confidence logits within LOGIT_TOL of their
    # scale (the head reads the chain's hidden states; without the draft's norm: 16 %), the inert
    # row's (-inf) exactly
    assert r["drafts_equal"] and r["conf_err"] <= LOGIT_TOL and r["conf_inert_equal"], r


@pytest.mark.parametrize("case", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row_kernels_equal_the_modules_step(results, case):
    """The eager layers with ``use_row_kernels_`` (every layer switched): a verify block of 8 and
    two rows of 7 (one padded token) within LOGIT_TOL of the plain modules' step with the same
    argmax, taps and K / V within ULP_TOL bf16 ulps, no other cache row touched."""
    name, layers, _, prompts, T, padded = case
    r = results[name]
    assert r["layers_switched"] == layers and r["shape"] == r["ref_shape"]
    # the step ran them: per layer two norms, one attention input, one SwiGLU (the final norm: the module's)
    assert r["kernel_calls"] == {"add_rmsnorm": 2 * layers, "qk_rope_cache": layers, "silu_mul": layers}, r
    assert r["rows_written"] == len(prompts) * T - padded
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["taps_shape"] == r["ref_taps_shape"] and r["taps_ulp"] <= ULP_TOL, r
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


def test_row_kernels_equal_the_draft_modules_block_pass(results):
    """The DSpark draft's layers with ``use_row_kernels_``: the block pass (N = 4, two rows, one
    inert) within LOGIT_TOL of the plain module's, same argmax, the block's K / V within ULP_TOL
    ulps, no other cache row touched (the inert row writes none); each layer ran the kernels."""
    r = results[DRAFT_ROW_CASE]
    n = r["layers"]
    assert n >= 2 and r["layers_switched"] == n and r["shape"] == r["ref_shape"] and r["rows_written"] == 4
    assert r["kernel_calls"] == {"add_rmsnorm": 2 * n, "qk_rope_cache": n, "silu_mul": n}, r
    assert r["logit_err"] <= LOGIT_TOL and r["argmax_equal"], r
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


def test_row_kernels_write_the_draft_context_as_the_modules(results):
    """The DSpark draft's context write with ``use_row_kernels_`` (rows of 9 and 0 positions):
    one ``add_rmsnorm`` (the hidden norm) and one ``qk_rope_cache`` per layer (k norm, RoPE, K / V
    write, no query heads) instead of ~17 launches a layer; the K / V of every layer within
    ULP_TOL bf16 ulps of the modules' write (a missing norm, RoPE or V is off by orders of
    magnitude), nothing else in the cache touched (the inert row writes none)."""
    r = results[DRAFT_CONTEXT_ROW_CASE]
    n = r["layers"]
    assert n >= 2 and r["kernel_calls"] == {"add_rmsnorm": 1, "qk_rope_cache": n}, r
    assert r["rows_written"] == 9
    assert r["kv_ulp"] <= ULP_TOL and not r["cache_changed_elsewhere"], r


@pytest.mark.parametrize("name", ["add_rmsnorm_64_plain", "add_rmsnorm_64_residual", "add_rmsnorm_96_plain",
                                  "add_rmsnorm_96_residual", "silu_mul_96", "silu_mul_1408"])
def test_norm_act_kernels_round_as_the_modules(results, name):
    """``add_rmsnorm``'s residual sum bit-equal to ``x + r``; its norm and ``silu_mul`` within one bf16
    ulp of ``RMSNorm`` / ``F.silu(gate) * up`` (fp32 sums and exp in another order), on at most 2 % of
    the values (a missing weight or rounding step is off everywhere)."""
    r = results[name]
    assert r.get("sum_equal", True) and r["ulp"] <= 1.0 and r["differ"] <= 0.02, r


def test_llm_decode_chain_gives_the_modules_tokens(llm_runs):
    """``DSPARK_DECODE_CHAIN=1``: an ``LLM`` of a tiny bf16 pair takes its AR steps, its verify
    blocks and its draft block passes (with the confidence head's hidden states in ``threshold``
    rounds) from the chains (prefills from the modules) and decodes greedily the tokens the
    modules give, AR, speculative and ``threshold`` alike; without it no chain is called."""
    r = llm_runs
    assert r["chain_calls_1"] > 0 and r["chain_calls_0"] == 0
    assert r["draft_chain_calls_1"] > 0 and r["draft_chain_calls_0"] == 0
    assert r["draft_confidence_chain_calls_1"] > 0 and r["draft_confidence_chain_calls_0"] == 0
    assert r["ar_1"] == r["ar_0"] == r["spec_1"] == r["spec_0"] == r["threshold_1"] == r["threshold_0"]


def test_llm_decode_chain_on_fp8_projections_gives_the_fp8_modules_tokens(llm_runs):
    """An ``LLM`` whose target's projections are fp8 (fused, block magnitudes 8x apart) runs its AR
    and verify steps through the chain with every projection's block scales and decodes greedily
    the tokens of the fp8 modules, AR and speculative alike; with its draft's projections in fp8 as
    well, the draft's block pass runs them through the chain, still lossless."""
    r = llm_runs
    assert r["fp8_chain_scales"] == ["down", "gate_up", "o", "qkv"]
    assert r["fp8_chain_calls_1"] > 0 and r["fp8_chain_calls_0"] == 0
    assert r["fp8_ar_1"] == r["fp8_ar_0"] == r["fp8_spec_1"] == r["fp8_spec_0"], r
    assert r["fp8_draft_chain_scales"] == ["down", "gate_up", "o", "qkv"]      # an fp8 draft's block pass
    assert r["fp8_draft_spec_1"] == r["fp8_ar_1"], r


def test_llm_decode_chain_with_a_draft_vocabulary(llm_runs):
    """The draft over half the vocabulary: its block passes run through the draft chain, whose
    head GEMV reads the set's rows only, and greedy speculative output is the modules' AR."""
    r = llm_runs
    assert r["draft_chain_calls_vocab"] > 0 and r["draft_chain_head_rows_vocab"] == 48
    assert r["spec_vocab"] == r["ar_0"]


def test_llm_decode_chain_beside_compiled_modules(llm_runs):
    """``compile`` with ``DSPARK_DECODE_CHAIN=1``: the chain takes the steps that fit it (AR steps of
    2 rows here, its limit cut to 4), the compiled modules the larger ones (verify blocks of 2 x 4,
    prefills), and greedy output is the plain modules' in every mode (on a GPU: the chain's one-token
    steps and the compiled modules' batch-16 verify, ``decode_paths.py --paths compiled_chain``)."""
    r = llm_runs
    assert r["chain_calls_compiled"] > 0 and r["module_calls_compiled"] > 0
    assert r["draft_chain_calls_compiled"] > 0
    assert r["ar_compiled"] == r["ar_0"] and r["spec_compiled"] == r["spec_0"]
    assert r["threshold_compiled"] == r["threshold_0"]


@pytest.mark.parametrize("flag,case,match", [
    ("2", "bf16", "set it to 1, 0 or auto"),
    ("1", "fp32", "bf16 only"),
    ("1", "cpu", "need a CUDA GPU"),
])
def test_decode_chain_refuses_what_it_cannot_run(monkeypatch, flag, case, match):
    """The env var asks for the chain; a target it cannot serve is a ConfigError naming why."""
    from dspark_trt.config import ConfigError
    from dspark_trt.models import build_models
    from dspark_trt.runtime import token_step
    from tests.support.models import tiny_pair
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", flag)
    monkeypatch.setattr(token_step, "INTERPRET", case != "cpu")         # this process: no interpreter
    target, _ = build_models(tiny_pair(), torch.float32 if case == "fp32" else torch.bfloat16, "cpu")
    with pytest.raises(ConfigError, match=match):
        token_step.chain_for(target, torch.device("cpu"))
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", "0")
    assert token_step.chain_for(target, torch.device("cpu")) is None


@pytest.mark.parametrize("case", ["fp32", "cpu", "tp2"])
def test_decode_chain_auto_runs_where_it_can(monkeypatch, case):
    """``auto``: the modules (None, no error) where the chain cannot serve the model: fp32
    weights, no GPU, tensor parallelism (``LLM`` then runs its modules)."""
    from dspark_trt.models import build_models
    from dspark_trt.runtime import token_step
    from tests.support.models import tiny_pair
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", "auto")
    monkeypatch.setattr(token_step, "INTERPRET", case != "cpu")
    target, _ = build_models(tiny_pair(), torch.float32 if case == "fp32" else torch.bfloat16, "cpu")
    device = torch.device("cpu") if case == "cpu" else torch.device("cuda", 0)   # fp32: past the device check
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert token_step.chain_for(target, device, tp_size=2 if case == "tp2" else 1) is None


def test_decode_chain_takes_weight_only_fp8_and_refuses_w8a8(monkeypatch):
    """fp8 projections (``--quantization fp8``) run the chain with their block scales; W8A8 ones
    (``fp8-w8a8``: activations quantised as well) would change the target's numerics in the chain's
    steps only, so "1" is a ConfigError naming why and "auto" keeps the modules."""
    from dspark_trt.config import ConfigError
    from dspark_trt.models import build_models
    from dspark_trt.models.fp8_linear import Fp8Linear, fp8_linears_
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.runtime import token_step
    from tests.support.models import tiny_pair
    monkeypatch.setattr(token_step, "INTERPRET", True)
    target, _ = build_models(tiny_pair(hidden=256, heads=2, kv_heads=1), torch.bfloat16, "cpu")
    fp8_linears_(target)
    fuse_projections_(target)
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", "1")
    chain = token_step.chain_for(target, torch.device("cpu"))
    assert {name: s.shape for name, s in chain.layers[0].scales.items()} == {
        "qkv": (4, 2), "o": (2, 2), "gate_up": (8, 2), "down": (2, 4)}
    assert chain.layers[0].qkv.dtype == torch.float8_e4m3fn and chain.lm_head.dtype == torch.bfloat16
    for m in target.modules():
        if isinstance(m, Fp8Linear) or hasattr(m, "weight_scale_inv"):
            m.act_quant = True
    with pytest.raises(ConfigError, match="weight-only fp8"):
        token_step.chain_for(target, torch.device("cpu"))
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert token_step.chain_for(target, torch.device("cuda", 0)) is None          # past the device check


def test_chain_for_launches_pdl_for_blocks_and_not_for_one_token_per_row(monkeypatch):
    """``LLM``'s chain (``chain_for``, sm_90): every launch of a step of several tokens per row with
    PDL, none of a one-token step (AR, any batch); a plain ``TokenStep(pdl=True)``: both with PDL.
    The kernels are stubbed (their launch flags recorded), so this runs without a GPU."""
    from dspark_trt.models import build_models
    from dspark_trt.plugins.kernels import common as kernels_common
    from dspark_trt.runtime import token_step
    from tests.support.models import tiny_pair
    target, _ = build_models(tiny_pair(), torch.bfloat16, "cpu")
    seen = []

    def gemv(x, w, *a, pdl=False, **k):
        seen.append(pdl)
        return torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)

    def rope(qkv, *a, pdl=False, **k):
        seen.append(pdl)
        return torch.zeros(qkv.shape[0], step.heads, step.head_dim, dtype=torch.bfloat16)

    def attention(q, *a, pdl=False, **k):
        seen.append(pdl)
        return torch.zeros_like(q)
    for name, fn in (("decode_gemv", gemv), ("qk_rope_cache", rope), ("block_attention_triton", attention)):
        monkeypatch.setattr(token_step, name, fn)
    monkeypatch.setenv("DSPARK_DECODE_CHAIN", "1")
    monkeypatch.setattr(token_step, "INTERPRET", True)
    monkeypatch.setattr(kernels_common, "gdc_wait", object())              # a Triton with PDL (common.pdl_capable)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    step = token_step.chain_for(target, torch.device("cuda", 0))
    assert step.pdl and not step.pdl_one_token
    cache, table = {"k": [None] * 3, "v": [None] * 3}, torch.zeros(2, 4, dtype=torch.long)
    launches = 1 + 3 * 6                                           # per layer 6, and the head
    for B, T, want in ((2, 1, False), (1, 4, True), (2, 3, True)):
        seen.clear()
        step(torch.ones(B, T, dtype=torch.long), torch.arange(T).expand(B, T), cache, table[:B])
        assert seen == [want] * launches, (B, T)
    seen.clear()
    token_step.TokenStep(target, pdl=True)(torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long),
                                           cache, table)
    assert seen == [True] * launches


@pytest.mark.parametrize("dtype,fuse,switched", [(torch.bfloat16, True, 3), (torch.bfloat16, False, 0),
                                                  (torch.float32, True, 0)])
def test_row_kernels_switch_only_fused_bf16_layers(dtype, fuse, switched):
    """``use_row_kernels_`` takes the layers with fused bf16 projections (the kernels round as the
    bf16 modules and read the fused rows), every part of each; others keep the torch ops."""
    from dspark_trt.models import build_models
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.models.qwen3 import use_row_kernels_
    from tests.support.models import tiny_pair
    target, _ = build_models(tiny_pair(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2), dtype, "cpu")
    if fuse:
        fuse_projections_(target)
    assert use_row_kernels_(target) == switched
    for layer in target.model.layers:
        assert layer.row_kernels == layer.self_attn.row_kernels == layer.mlp.row_kernels == bool(switched)


def test_refuses_weights_that_are_not_bf16():
    from dspark_trt.models import build_models
    from dspark_trt.runtime.token_step import TokenStep
    from tests.support.models import tiny_pair
    target, _ = build_models(tiny_pair(), torch.float32, "cpu")
    with pytest.raises(ValueError, match="bf16 only; qkv, o, gate_up, down"):
        TokenStep(target)


@pytest.mark.parametrize("kwargs,match", [
    (dict(qkv_size=100), "qkv has 100 values"),
    (dict(fp32=True), "qkv, q_norm, k_norm, cos, sin must be bfloat16"),
    (dict(pdl=True), "pdl=True needs a CUDA GPU"),
])
def test_qk_rope_cache_names_bad_arguments(kwargs, match):
    from dspark_trt.plugins.kernels.qk_rope_cache import qk_rope_cache
    H, Hkv, D = 4, 2, 16
    dt = torch.float32 if kwargs.pop("fp32", False) else torch.bfloat16
    qkv = torch.randn(kwargs.pop("qkv_size", (H + 2 * Hkv) * D)).to(dt)
    ones = torch.ones(D, dtype=dt)
    cache = torch.zeros(3, 4, Hkv, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        qk_rope_cache(qkv, ones, ones, ones, ones, cache, cache.clone(), torch.tensor([0, 1]),
                      torch.tensor([2]), H, 1e-6, **kwargs)


def _qwen3_8b_two_layers():
    """Two layers at Qwen3-8B dims (d 4096, 32 / 8 heads of 128, I 12288), bf16 on the GPU, fused
    projections, layer 0 tapped, seed 0."""
    from dspark_trt.config import Qwen3Config
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.models.qwen3 import Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=32000, hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg, tap_layer_ids=(0,)).to(torch.bfloat16)
    fuse_projections_(model)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_qwen3_8b_layers_on_gpu(pdl, T):
    """Two layers at Qwen3-8B dims (d 4096, 32 / 8 heads of 128, I 12288), a 300-token context,
    one token or a verify block of 8: the chain's logits within LOGIT_TOL of the module step's,
    same argmaxes, the step's K / V within ULP_TOL ulps; with PDL the same bits as without."""
    from dspark_trt.runtime.token_step import TokenStep
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    model = _qwen3_8b_two_layers()
    cache = model.make_cache(24, 16, torch.bfloat16, "cuda")
    table = torch.arange(24, device="cuda")[None]
    L = 300
    copy = lambda c: {k: [t.clone() for t in v] for k, v in c.items()}  # noqa: E731
    with torch.inference_mode():
        model(torch.randint(0, 32000, (1, L), device="cuda"), torch.arange(L, device="cuda")[None], table, cache)
        ref_cache, plain_cache = copy(cache), copy(cache)
        tokens = torch.randint(0, 32000, (1, T), device="cuda")
        pos = L + torch.arange(T, device="cuda")[None]
        ref, ref_taps = model(tokens, pos, table, ref_cache)
        logits, taps = TokenStep(model, pdl=pdl)(tokens, pos, cache, table)
        plain = TokenStep(model)(tokens, pos, plain_cache, table)
    ref, got = ref[0].float(), logits[0].float()
    assert float((got - ref).abs().max() / ref.abs().max()) <= LOGIT_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert taps.shape == ref_taps.shape
    for a, b in zip(cache["k"] + cache["v"], ref_cache["k"] + ref_cache["v"]):
        assert ulp_err(a.reshape(-1, 8, 128)[L:L + T], b.reshape(-1, 8, 128)[L:L + T].float()) <= ULP_TOL
    if pdl:
        assert torch.equal(logits, plain[0]) and torch.equal(taps, plain[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_kernels_at_qwen3_8b_dims_on_gpu():
    """Two layers at Qwen3-8B dims, 16 rows of 8 tokens (a batch-16 verify, past the chain) over a
    300-token context: the module step with ``use_row_kernels_`` within LOGIT_TOL of the plain
    module step, same argmaxes, the step's K / V within ULP_TOL ulps of it."""
    import copy
    from dspark_trt.models.qwen3 import use_row_kernels_
    model = _qwen3_8b_two_layers()
    rows = copy.deepcopy(model)
    assert use_row_kernels_(rows) == 2
    B, T, L, pages = 16, 8, 300, 20                            # 20 pages of 16 per row
    cache = model.make_cache(B * pages, 16, torch.bfloat16, "cuda")
    table = torch.arange(B * pages, device="cuda").view(B, pages)
    copy_of = lambda c: {k: [t.clone() for t in v] for k, v in c.items()}  # noqa: E731
    with torch.inference_mode():
        model(torch.randint(0, 32000, (B, L), device="cuda"), torch.arange(L, device="cuda").expand(B, L), table, cache)
        ref_cache = copy_of(cache)
        tokens = torch.randint(0, 32000, (B, T), device="cuda")
        pos = (L + torch.arange(T, device="cuda")).expand(B, T)
        ref, ref_taps = model(tokens, pos, table, ref_cache)
        got, taps = rows(tokens, pos, table, cache)
    ref, got = ref.float(), got.float()
    assert float((got - ref).abs().max() / ref.abs().max()) <= LOGIT_TOL
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.99    # near-ties of random weights
    assert taps.shape == ref_taps.shape
    for a, b in zip(cache["k"] + cache["v"], ref_cache["k"] + ref_cache["v"]):
        row_a, row_b = (t[:B * pages].view(B, pages * 16, 8, 128)[:, L:L + T] for t in (a, b))  # no pad page
        assert ulp_err(row_a, row_b.float()) <= ULP_TOL


def _qwen3_8b_draft(pages: int):
    """A two-layer DSpark draft at Qwen3-8B dims (block 7), bf16 on the GPU, fused projections,
    seed 0, and its cache of ``pages`` pages of 16 filled with random K / V (a context)."""
    from dspark_trt.config import DSparkConfig, Qwen3Config
    from dspark_trt.models.dspark_qwen3 import DSparkQwen3Draft
    from dspark_trt.models.fuse import fuse_projections_
    cfg = Qwen3Config(vocab_size=32000, hidden_size=4096, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    dcfg = DSparkConfig(backbone=cfg, num_hidden_layers=2, block_size=7, mask_token_id=31999,
                        target_layer_ids=[1, 2], markov_rank=64, num_target_layers=4)
    torch.manual_seed(0)
    with torch.device("cuda"):
        embed, head = torch.nn.Embedding(32000, 4096), torch.nn.Linear(4096, 32000, bias=False)
        draft = DSparkQwen3Draft(dcfg, embed, head).to(torch.bfloat16)
    fuse_projections_(draft)
    cache = draft.make_cache(pages, 16, torch.bfloat16, "cuda")
    for c in cache["k"] + cache["v"]:
        c.normal_()
    return draft, cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_kernels_in_the_qwen3_8b_draft_block_on_gpu():
    """The same draft's block pass for 16 rows (112 tokens, past the chain) with ``use_row_kernels_``:
    base logits within LOGIT_TOL of the plain module's, argmaxes equal on >= 99 % of the tokens."""
    import copy
    from dspark_trt.models.qwen3 import use_row_kernels_
    draft, cache = _qwen3_8b_draft(16 * 20)
    rows = copy.deepcopy(draft)
    assert use_row_kernels_(rows) == 2
    table = torch.arange(16 * 20, device="cuda").view(16, 20)
    anchor = torch.randint(0, 32000, (16,), device="cuda")
    start = torch.full((16,), 300, device="cuda")
    with torch.inference_mode():
        ref = draft.block(anchor, start, table, {k: [t.clone() for t in v] for k, v in cache.items()}, 7)
        got = rows.block(anchor, start, table, cache, 7)
    ref, got = ref.float(), got.float()
    assert float((got - ref).abs().max() / ref.abs().max()) <= LOGIT_TOL
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_kernels_write_the_qwen3_8b_draft_context_on_gpu():
    """The same draft's context write of 16 rows of 40 positions (one row inert, one ending at
    a page's middle) with ``use_row_kernels_``: the written K / V of both layers within ULP_TOL
    ulps of the plain module's write, every other cache row untouched."""
    import copy
    from dspark_trt.models.qwen3 import use_row_kernels_
    draft, cache = _qwen3_8b_draft(16 * 4)
    rows = copy.deepcopy(draft)
    assert use_row_kernels_(rows) == 2
    table = torch.arange(16 * 4, device="cuda").view(16, 4)
    pos = torch.arange(40, device="cuda").repeat(16, 1)
    pos[3] = -1                                                  # inert
    pos[5, 27:] = -1                                             # ends inside a page
    taps = torch.randn(16, 40, draft.fc.in_features, device="cuda").to(torch.bfloat16)
    ref_cache = {k: [t.clone() for t in v] for k, v in cache.items()}
    before = {k: [t.clone() for t in v] for k, v in cache.items()}
    with torch.inference_mode():
        draft.context(taps, pos, table, ref_cache)
        rows.context(taps, pos, table, cache)
    written = torch.zeros(16, 64, dtype=torch.bool, device="cuda")
    written[:, :40] = pos >= 0
    for a, b, c in zip(cache["k"] + cache["v"], ref_cache["k"] + ref_cache["v"], before["k"] + before["v"]):
        a, b, c = (t[:16 * 4].view(16, 64, 8, 128) for t in (a, b, c))
        assert ulp_err(a[written], b[written].float()) <= ULP_TOL
        assert not torch.equal(a[written], c[written])                       # it wrote
        assert torch.equal(a[~written], c[~written])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True])
def test_qwen3_8b_draft_block_on_gpu(pdl):
    """A two-layer DSpark draft at Qwen3-8B dims over a 300-token context, the block of N = 7:
    the chain's base logits within LOGIT_TOL of ``DSparkQwen3Draft.block``'s, same argmaxes."""
    from dspark_trt.runtime.token_step import TokenStep
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    draft, cache = _qwen3_8b_draft(24)
    table = torch.arange(24, device="cuda")[None]
    anchor, start = torch.tensor([17], device="cuda"), torch.tensor([300], device="cuda")
    with torch.inference_mode():
        ref = draft.block(anchor, start, table, {k: [t.clone() for t in v] for k, v in cache.items()}, 7)
        got = TokenStep(draft, pdl=pdl).draft_logits(anchor, start, cache, table, 7)
    ref, got = ref[0].float(), got[0].float()
    assert float((got - ref).abs().max() / ref.abs().max()) <= LOGIT_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
