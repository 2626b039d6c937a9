"""``runtime.token_step.TokenStep`` under ``TRITON_INTERPRET=1`` (run as a subprocess by
tests/runtime/test_token_step.py): a tiny bf16 Qwen3 target (fused and unfused projections, taps
of the first and a middle layer) prefilled by its own forward, then one decode step through the
kernel chain and through the module's forward on a copy of the caches: one token, a verify block
of one row, two rows of different lengths (one padded). Prints ``RESULT {json}``: per case the
logits' largest error over their scale, whether the argmaxes agree, the taps' and the written K /
V's errors in bf16 ulps, and whether anything besides the step's cache rows changed."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

from tests.support.skinny_gemm_cases import ulp_err

# (name, layers, taps, fused, prompt lengths per row, step tokens per row, padded last token of row 1)
CASES = [
    ("one_token_unfused", 3, (0, 1), False, (5,), 1, False),
    ("one_token_fused_page_boundary", 2, (0,), True, (8,), 1, False),
    ("verify_block_of_4", 3, (0, 1), True, (6,), 4, False),
    ("two_rows_one_padded", 2, (0,), True, (3, 9), 3, True),
]
PAGE, PAGES = 4, 12
TABLES = [[5, 2, 7, 0, -1, -1], [1, 9, 3, 11, 4, -1]]


def attention_in_fp32(kernel):
    """The attention kernel on fp32 copies of q and the caches, its output rounded to bf16: under
    the interpreter its bf16 path returns garbage (its fp32 path matches the reference, tests/
    support/plugins_cases.py; bf16 runs on the GPU, tests/plugins/test_plugins_gpu.py)."""
    def run(q, k_cache, v_cache, *args, **kw):
        return kernel(q.float(), k_cache.float(), v_cache.float(), *args, **kw).to(q.dtype)
    return run


def llm_runs() -> dict:
    """``LLM`` with ``DSPARK_DECODE_CHAIN=1`` on a tiny bf16 pair with a confidence head: greedy AR,
    speculative (fixed N) and ``threshold`` output with the chain, the same of the plain modules,
    and how many target calls and draft block passes (plain, with the head's hidden states) the
    chains took (prefills go to the modules); "compiled": the chain beside compiled modules
    (``compile="aot_eager"``), its target steps cut to 4 rows so that the verify blocks (2 x 4
    rows) and prefills run through the compiled modules (``module_calls_compiled``)."""
    from dspark_trt.models import build_models
    from dspark_trt.runtime import SamplingParams, token_step
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.networks import DECODE_CHAIN_ENV
    from tests.support.models import scale_weights_, tiny_pair
    token_step.block_attention_triton = attention_in_fp32(token_step.block_attention_triton)
    pair = tiny_pair(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, taps=(0,), block=3)
    target, draft = build_models(pair, torch.bfloat16, "cpu", seed=3)
    scale_weights_(target, 4.0)
    torch.manual_seed(3)
    draft.add_confidence_head()
    prompts, sp = [[1, 2, 3, 4], [5, 6]], SamplingParams(max_new_tokens=6)
    threshold = SamplingParams(max_new_tokens=6, verify_mode="threshold", confidence_threshold=0.3)
    out = {}
    for chain in ("1", "0", "compiled"):
        os.environ[DECODE_CHAIN_ENV] = "0" if chain == "0" else "1"
        llm = LLM(pair, target, draft, max_batch_size=2, max_seq_len=48, page_size=8,
                  compile="aot_eager" if chain == "compiled" else False)
        calls = {"target": 0, "draft": 0, "draft_confidence": 0, "modules": 0}
        if chain == "compiled":     # the hybrid: the chain's steps of <= 4 rows, the compiled modules' larger
            module = llm.networks.target_module
            llm.networks.target_module = lambda *a, _m=module: (calls.__setitem__("modules", calls["modules"] + 1),
                                                                 _m(*a))[1]
        if llm.networks.decode_chain is not None:
            _count_chain_calls(llm.networks, calls, "target", max_rows=4 if chain == "compiled" else None)
        if llm.networks.draft_chain is not None:
            block = llm.networks.draft_chain.draft_logits
            def counted(*a, _b=block, **kw):
                key = "draft_confidence" if kw.get("hidden") else "draft"
                calls[key] += 1
                return _b(*a, **kw)
            llm.networks.draft_chain.draft_logits = counted
        out[f"ar_{chain}"] = [o.output_ids for o in llm.generate(prompts, sp, speculative=False)]
        out[f"spec_{chain}"] = [o.output_ids for o in llm.generate(prompts, sp)]
        out[f"threshold_{chain}"] = [o.output_ids for o in llm.generate(prompts, threshold)]
        out[f"chain_calls_{chain}"], out[f"draft_chain_calls_{chain}"] = calls["target"], calls["draft"]
        out[f"draft_confidence_chain_calls_{chain}"] = calls["draft_confidence"]
        out[f"module_calls_{chain}"] = calls["modules"]
    out.update(draft_vocab_run(pair, target, draft, prompts, sp))
    out.update(fp8_llm_run(prompts, sp))
    return out


def _count_chain_calls(networks, calls: dict, key: str, max_rows: int | None = None) -> None:
    """``networks.decode_chain`` wrapped to add one to ``calls[key]`` per call; the wrapper keeps the
    chain's ``max_rows`` (or takes ``max_rows``)."""
    step = networks.decode_chain
    networks.decode_chain = lambda *a: (calls.__setitem__(key, calls[key] + 1), step(*a))[1]
    networks.decode_chain.max_rows = max_rows or step.max_rows


def fp8_llm_run(prompts, sp) -> dict:
    """``LLM`` on a tiny pair whose target's projections are fp8 (``--quantization fp8``: e4m3,
    128x128 block scales, q/k/v and gate/up fused; block magnitudes 8x apart): greedy AR and
    speculative output with the chain (its layers' scales) and with the fp8 modules, the chain's
    target calls; then with the draft's projections in fp8 too (``--draft-quantization fp8``): the
    draft chain's scales and the speculative output."""
    from dspark_trt.models import build_models
    from dspark_trt.models.fp8_linear import fp8_linears_
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.networks import DECODE_CHAIN_ENV
    from tests.support.models import scale_weights_, tiny_pair
    pair = tiny_pair(vocab=96, hidden=256, layers=2, heads=2, kv_heads=1, taps=(0,), block=3)
    target, draft = build_models(pair, torch.bfloat16, "cpu", seed=5)
    scale_weights_(target, 4.0)
    _blockwise_magnitudes_(target, seed=5)
    fp8_linears_(target)
    fuse_projections_(target)
    out = {}
    for chain in ("1", "0"):
        os.environ[DECODE_CHAIN_ENV] = chain
        llm = LLM(pair, target, draft, max_batch_size=2, max_seq_len=48, page_size=8)
        calls = {"target": 0}
        if llm.networks.decode_chain is not None:
            out["fp8_chain_scales"] = sorted(llm.networks.decode_chain.layers[0].scales)
            _count_chain_calls(llm.networks, calls, "target")
        out[f"fp8_ar_{chain}"] = [o.output_ids for o in llm.generate(prompts, sp, speculative=False)]
        out[f"fp8_spec_{chain}"] = [o.output_ids for o in llm.generate(prompts, sp)]
        out[f"fp8_chain_calls_{chain}"] = calls["target"]
    fp8_linears_(draft)                                   # --draft-quantization fp8 as well: the draft's chain
    fuse_projections_(draft)
    os.environ[DECODE_CHAIN_ENV] = "1"
    llm = LLM(pair, target, draft, max_batch_size=2, max_seq_len=48, page_size=8)
    out["fp8_draft_chain_scales"] = sorted(llm.networks.draft_chain.layers[0].scales)
    out["fp8_draft_spec_1"] = [o.output_ids for o in llm.generate(prompts, sp)]
    return out


def draft_vocab_run(pair, target, draft, prompts, sp) -> dict:
    """The draft over half the vocabulary (``models/draft_vocab.py``) with the chain: its block
    passes through the draft chain (the chain's head is the set's), the speculative tokens."""
    import copy
    from dspark_trt.models.draft_vocab import restrict_draft_vocab_
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.networks import DECODE_CHAIN_ENV
    os.environ[DECODE_CHAIN_ENV] = "1"
    sub = copy.deepcopy(draft)
    sub.lm_head = draft.lm_head
    restrict_draft_vocab_(sub, torch.arange(0, pair.target.vocab_size, 2))
    llm = LLM(pair, target, sub, max_batch_size=2, max_seq_len=48, page_size=8)
    chain = llm.networks.draft_chain
    calls, block = [0], chain.draft_logits
    chain.draft_logits = lambda *a, **kw: (calls.__setitem__(0, calls[0] + 1), block(*a, **kw))[1]
    out = [o.output_ids for o in llm.generate(prompts, sp)]
    return {"spec_vocab": out, "draft_chain_calls_vocab": calls[0],
            "draft_chain_head_rows_vocab": int(chain.lm_head.shape[0])}


# (name, rows' context lengths (0: an inert row, anchor -1), N)
DRAFT_CASES = [("draft_block_of_4", (6,), 4), ("draft_two_rows_one_inert", (9, 0), 3)]


def draft_cases() -> dict:
    """Per case of ``DRAFT_CASES``: a tiny bf16 DSpark draft's block pass through the chain
    (``TokenStep.draft_logits``) against the module's (``block``) on a copy of the draft cache
    after a context write: the live rows' base logits' error over their scale, whether the
    argmaxes agree, the block's K / V errors in bf16 ulps, whether anything else changed."""
    from dspark_trt.models import build_models
    from dspark_trt.runtime import token_step
    from dspark_trt.runtime.token_step import TokenStep
    from tests.support.models import tiny_pair
    token_step.block_attention_triton = attention_in_fp32(token_step.block_attention_triton)
    out = {}
    for i, (name, ctx, N) in enumerate(DRAFT_CASES):
        pair = tiny_pair(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, taps=(0, 1), block=N)
        _, draft = build_models(pair, torch.bfloat16, "cpu", seed=10 + i)
        r, (anchor, start, table, before, live_rows) = _draft_block_case(
            draft, ctx, N, i, lambda anchor, start, cache, table: TokenStep(draft).draft_logits(anchor, start, cache,
                                                                                                table, N))
        out[name] = {**r, **_confidence_case(draft, anchor, start, table, before, N, live_rows)}
    return out


def _draft_block_case(draft, ctx, N: int, seed: int, block) -> tuple[dict, tuple]:
    """``draft``'s context written for rows of ``ctx`` tokens (0: an inert row), then its block pass
    through ``block(anchor, start, cache, table)`` and through the module's ``block`` on a copy of
    the cache: the live rows' base logits' error over their scale, whether the argmaxes agree, the
    block's K / V in bf16 ulps, whether anything else changed; and (anchor, start, table, the cache
    before the block, the live rows)."""
    B, gen = len(ctx), torch.Generator().manual_seed(seed)
    cache = draft.make_cache(PAGES, PAGE, torch.bfloat16, "cpu")
    table = torch.tensor(TABLES[:B])
    L = max(ctx)
    pos = torch.stack([torch.where(torch.arange(L) < n, torch.arange(L), -1) for n in ctx])
    taps = torch.randn(B, L, draft.fc.in_features, generator=gen).to(torch.bfloat16)
    live_rows = torch.tensor([n > 0 for n in ctx])
    anchor = torch.where(live_rows, torch.randint(0, 96, (B,), generator=gen), -1)
    start = torch.where(live_rows, torch.tensor(ctx), -1)         # the anchor: after the context
    with torch.inference_mode():
        draft.context(taps, pos, table, cache)
        ref_cache = {k: [c.clone() for c in v] for k, v in cache.items()}
        before = {k: [c.clone() for c in v] for k, v in cache.items()}
        ref = draft.block(anchor, start, table, ref_cache, N)
        got = block(anchor, start, cache, table)
    _, block_pos, _ = draft.block_inputs(anchor, start, N)
    live = block_pos >= 0
    ref_l, got_l = ref[live].float(), got[live].float()
    rows = [table[b, p // PAGE].item() * PAGE + p % PAGE for b, p in zip(*torch.nonzero(live, as_tuple=True))
            for p in [block_pos[b, p].item()]]
    return ({"logit_err": float((got_l - ref_l).abs().max() / ref_l.abs().max()),
             "argmax_equal": bool(torch.equal(got_l.argmax(-1), ref_l.argmax(-1))),
             "shape": list(got.shape), "ref_shape": list(ref.shape), "rows_written": len(rows),
             **_cache_errors(cache, ref_cache, before, rows)},
            (anchor, start, table, before, live_rows))


def _confidence_case(draft, anchor, start, table, cache, N, live_rows) -> dict:
    """The block's greedy drafts and confidence logits through the chain (``draft_logits(hidden=
    True)`` + ``sample``) against the module's ``forward(with_confidence=True)``, each on its own
    copy of ``cache``: whether the live rows' drafts agree, the confidence logits' largest error over their scale."""
    from dspark_trt.runtime.token_step import TokenStep
    torch.manual_seed(0)
    draft.add_confidence_head()
    B = anchor.shape[0]
    temperature, seed = torch.zeros(B), torch.arange(B)
    copy = lambda: {k: [c.clone() for c in v] for k, v in cache.items()}  # noqa: E731
    with torch.inference_mode():
        ref_d, _, ref_c = draft(anchor, start, table, temperature, seed, copy(), with_confidence=True,
                                num_spec_tokens=N)
        U, h = TokenStep(draft).draft_logits(anchor, start, copy(), table, N, hidden=True)
        got_d, _, got_c = draft.sample(U, anchor, temperature, seed, start, "exact", h)
    live = live_rows
    return {"drafts_equal": bool(torch.equal(got_d[live], ref_d[live])),
            "conf_err": float((got_c[live] - ref_c[live]).abs().max() / ref_c[live].abs().max()),
            "conf_inert_equal": bool(torch.equal(got_c[~live], ref_c[~live]))}


def _cache_errors(cache, ref_cache, before, rows) -> dict:
    """The written ``rows`` (flat page-slot indices) of every layer's K / V against the reference
    cache in bf16 ulps, and whether any other row differs from ``before``."""
    changed_elsewhere, kv_ulp = False, 0.0
    for kind in ("k", "v"):
        for a, b, c in zip(cache[kind], ref_cache[kind], before[kind]):
            a2, b2, c2 = (t.reshape(-1, *t.shape[2:]).clone() for t in (a, b, c))
            kv_ulp = max(kv_ulp, ulp_err(a2[rows], b2[rows].float()))
            a2[rows], c2[rows] = 0, 0
            changed_elsewhere |= not torch.equal(a2, c2)        # the pad page included
    return {"kv_ulp": kv_ulp, "cache_changed_elsewhere": changed_elsewhere}


def write_results(out, mode: str) -> None:
    """``step_cases()`` ("steps") or ``llm_runs()`` ("llm") into ``out``/results.json (a background
    job of tests/runtime/test_token_step.py, tests/support/prebuilt.py, TRITON_INTERPRET=1)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the interpreter cases need TRITON_INTERPRET=1"
    (out / "results.json").write_text(json.dumps(llm_runs() if mode == "llm" else step_cases()))


def step_cases() -> dict:
    """Per case of ``CASES``: the chain's step against the module's (module doc)."""
    from dspark_trt.models import build_models
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.runtime import token_step
    from tests.support.models import scale_weights_, tiny_pair
    token_step.block_attention_triton = attention_in_fp32(token_step.block_attention_triton)
    out = {}
    for i, (name, layers, taps, fused, prompts, T, padded) in enumerate(CASES):
        pair = tiny_pair(vocab=96, hidden=64, layers=layers, heads=4, kv_heads=2, taps=taps)
        target, _ = build_models(pair, torch.bfloat16, "cpu", seed=i)
        scale_weights_(target, 4.0)
        if fused:
            fuse_projections_(target)
        out[name] = _step_case(target, prompts, T, padded, i)
    for name, T in DEFAULT_DIMS_CASES:            # the default pair's layer dims (non-power-of-two MLP)
        target, _ = build_models(default_dims_pair(), torch.bfloat16, "cpu", seed=7)
        fuse_projections_(target)
        out[name] = _step_case(target, (5,), T, False, 7)
    return {**out, **fp8_cases(), **draft_cases(), **deep_cases(), **row_kernel_cases(), **norm_act_cases()}


# weight-only fp8 projections (e4m3, 128x128 block scales; dims of multiples of 128 so q/k/v and
# gate/up fuse), fused and unfused: one token and a verify block of 8
FP8_CASES = [("fp8_one_token_fused", True, 1), ("fp8_verify_block_of_8_fused", True, 8),
             ("fp8_verify_block_of_8_unfused", False, 8)]


def fp8_cases() -> dict:
    """Per case of ``FP8_CASES``: the chain's step on fp8 projections against the fp8 modules'."""
    from dspark_trt.models import build_models
    from dspark_trt.models.fp8_linear import fp8_linears_
    from dspark_trt.models.fuse import fuse_projections_
    from tests.support.models import scale_weights_, tiny_pair
    out = {}
    for name, fused, T in FP8_CASES:
        target, _ = build_models(tiny_pair(vocab=96, hidden=256, layers=2, heads=2, kv_heads=1, taps=(0,)),
                                 torch.bfloat16, "cpu", seed=11)
        scale_weights_(target, 4.0)
        _blockwise_magnitudes_(target, seed=11)
        fp8_linears_(target)
        if fused:
            fuse_projections_(target)
        out[name] = _step_case(target, (5,), T, False, 11)
    return out


def _blockwise_magnitudes_(target, seed: int) -> None:
    """Each 128x128 block of every projection times 2^j, j in -2..1, so that the fp8 scale blocks
    differ (a scale read from the wrong block is then off by up to 8x)."""
    from dspark_trt.models.fp8_linear import is_fp8_projection
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, lin in target.named_modules():
            if is_fp8_projection(name, lin):
                N, K = lin.weight.shape
                j = torch.randint(-2, 2, (-(-N // 128), -(-K // 128)), generator=gen).float()
                lin.weight.mul_((2.0 ** j).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K].to(lin.weight.dtype))


# (name, layers, taps, prompt lengths per row, step tokens per row, padded last token of row 1)
ROW_CASES = [("rows_verify_block_of_8", 3, (0, 1), (6,), 8, False),
             ("rows_two_rows_one_padded", 2, (0,), (3, 9), 7, True)]
DRAFT_ROW_CASE = "rows_draft_block_two_rows_one_inert"      # N = 4, context rows of 9 and 0
DRAFT_CONTEXT_ROW_CASE = "rows_draft_context_two_rows_one_inert"   # context rows of 9 and 0


def row_kernel_cases() -> dict:
    """Per case of ``ROW_CASES``: the module's own step with ``use_row_kernels_`` (one launch per
    norm + residual add, per q/k norm + RoPE + cache write, per SwiGLU) against the plain module
    step, as ``_step_case`` compares the chain."""
    from dspark_trt.models import build_models
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.models.qwen3 import use_row_kernels_
    from dspark_trt.plugins.kernels import norm_act, qk_rope_cache
    from tests.support.models import scale_weights_, tiny_pair
    calls: dict[str, int] = {}

    def counted(mod, fn_name):
        fn = getattr(mod, fn_name)

        def wrapper(*a, **kw):
            calls[fn_name] = calls.get(fn_name, 0) + 1
            return fn(*a, **kw)
        setattr(mod, fn_name, wrapper)
    for mod, fn_name in ((norm_act, "add_rmsnorm"), (norm_act, "silu_mul"), (qk_rope_cache, "qk_rope_cache")):
        counted(mod, fn_name)
    out = {}
    for i, (name, layers, taps, prompts, T, padded) in enumerate(ROW_CASES):
        calls.clear()
        pair = tiny_pair(vocab=96, hidden=64, layers=layers, heads=4, kv_heads=2, taps=taps)
        target, _ = build_models(pair, torch.bfloat16, "cpu", seed=20 + i)
        scale_weights_(target, 4.0)
        fuse_projections_(target)
        rows = copy.deepcopy(target)
        switched = use_row_kernels_(rows)
        out[name] = {**_step_case(target, prompts, T, padded, 20 + i,
                                  step=lambda tok, pos, cache, table, _m=rows: _m(tok, pos, table, cache)),
                     "layers_switched": switched, "kernel_calls": dict(calls)}
    # the DSpark draft's block pass (its layers are Qwen3 decoder layers, non-causal over the block)
    calls.clear()
    pair = tiny_pair(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, taps=(0, 1), block=4)
    _, draft = build_models(pair, torch.bfloat16, "cpu", seed=30)
    fuse_projections_(draft)
    rows = copy.deepcopy(draft)
    switched = use_row_kernels_(rows)
    r, _ = _draft_block_case(draft, (9, 0), 4, 30,
                             lambda anchor, start, cache, table: rows.block(anchor, start, table, cache, 4))
    out[DRAFT_ROW_CASE] = {**r, "layers": len(rows.layers), "layers_switched": switched, "kernel_calls": dict(calls)}
    calls.clear()
    out[DRAFT_CONTEXT_ROW_CASE] = {**_draft_context_case(draft, rows, (9, 0), 31), "kernel_calls": dict(calls)}
    return out


def _draft_context_case(draft, rows, ctx, seed: int) -> dict:
    """The draft's context of rows of ``ctx`` tokens (0: an inert row, positions -1) written by
    ``rows`` (its layers switched to the row kernels) and by ``draft`` on another cache: the
    written K / V in bf16 ulps, whether anything else changed."""
    B, gen = len(ctx), torch.Generator().manual_seed(seed)
    table = torch.tensor(TABLES[:B])
    L = max(ctx)
    pos = torch.stack([torch.where(torch.arange(L) < n, torch.arange(L), -1) for n in ctx])
    taps = (2 * torch.randn(B, L, draft.fc.in_features, generator=gen)).to(torch.bfloat16)
    cache, ref_cache = (draft.make_cache(PAGES, PAGE, torch.bfloat16, "cpu") for _ in range(2))
    before = {k: [c.clone() for c in v] for k, v in cache.items()}
    with torch.inference_mode():
        draft.context(taps, pos, table, ref_cache)
        rows.context(taps, pos, table, cache)
    written = [table[b, p // PAGE].item() * PAGE + p % PAGE for b, p in zip(*torch.nonzero(pos >= 0, as_tuple=True))
               for p in [pos[b, p].item()]]
    return {"rows_written": len(written), "layers": len(rows.layers), **_cache_errors(cache, ref_cache, before, written)}


def norm_act_cases() -> dict:
    """``add_rmsnorm`` (with and without the residual, rows of 64 and of 96: a masked row) and
    ``silu_mul`` (K = 96: blocks of 32; K = 1408: blocks of 128) against the modules' torch ops:
    the largest error in bf16 ulps and the share of values that differ; the sum exactly."""
    import torch.nn.functional as F
    from dspark_trt.models.layers import RMSNorm
    from dspark_trt.plugins.kernels.norm_act import add_rmsnorm, silu_mul
    gen = torch.Generator().manual_seed(5)
    out = {}
    for N in (64, 96):
        x, r = (4 * torch.randn(7, 3, N, generator=gen)).to(torch.bfloat16), torch.randn(7, 3, N, generator=gen).to(torch.bfloat16)
        norm = RMSNorm(N, 1e-6).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + torch.rand(N, generator=gen))
        for res in (False, True):
            y, h = add_rmsnorm(x, r if res else None, norm.weight.detach(), norm.eps)
            want_h = x + r if res else x
            want = norm(want_h).detach()
            out[f"add_rmsnorm_{N}_{'residual' if res else 'plain'}"] = {
                "sum_equal": bool(torch.equal(h, want_h)), "ulp": ulp_err(y, want.float()),
                "differ": float((y != want).float().mean()), "shape": list(y.shape)}
    for K in (96, 1408):
        gu = (3 * torch.randn(5, 2 * K, generator=gen)).to(torch.bfloat16)
        got, want = silu_mul(gu), F.silu(gu[:, :K]) * gu[:, K:]
        out[f"silu_mul_{K}"] = {"ulp": ulp_err(got, want.float()), "differ": float((got != want).float().mean()),
                                "shape": list(got.shape)}
    return out


def _step_case(target, prompts, T: int, padded: bool, seed: int, step=None) -> dict:
    """``target`` prefilled with random prompts of ``prompts`` tokens per row, then one step of T
    tokens per row through the chain (or ``step(tokens, positions, cache, table)``) and through the
    module on a copy of the caches."""
    from dspark_trt.runtime.token_step import TokenStep
    vocab = target.config.vocab_size
    B, gen = len(prompts), torch.Generator().manual_seed(seed)
    cache = target.make_cache(PAGES, PAGE, torch.bfloat16, "cpu")
    table = torch.tensor(TABLES[:B])
    L = max(prompts)
    ids = torch.randint(0, vocab, (B, L), generator=gen)
    pos = torch.stack([torch.where(torch.arange(L) < n, torch.arange(L), -1) for n in prompts])
    tokens = torch.randint(0, vocab, (B, T), generator=gen)
    step_pos = torch.stack([n + torch.arange(T) for n in prompts])
    if padded:
        step_pos[1, -1] = -1
    with torch.inference_mode():
        target(ids, pos, table, cache)
        ref_cache = {k: [c.clone() for c in v] for k, v in cache.items()}
        before = {k: [c.clone() for c in v] for k, v in cache.items()}
        ref_logits, ref_taps = target(tokens, step_pos, table, ref_cache)
        logits, tap = (step or TokenStep(target))(tokens, step_pos, cache, table)
    live = step_pos >= 0
    ref_l, got_l = ref_logits[live].float(), logits[live].float()
    rows = [table[b, p // PAGE].item() * PAGE + p % PAGE for b, p in zip(*torch.nonzero(live, as_tuple=True))
            for p in [step_pos[b, p].item()]]
    return {
        "logit_err": float((got_l - ref_l).abs().max() / ref_l.abs().max()),
        "argmax_equal": bool(torch.equal(got_l.argmax(-1), ref_l.argmax(-1))),
        "shape": list(logits.shape), "ref_shape": list(ref_logits.shape),
        "taps_shape": list(tap.shape), "ref_taps_shape": list(ref_taps.shape),
        "taps_ulp": ulp_err(tap[live], ref_taps[live].float()) if tap.numel() else 0.0,
        "logits_dtype": str(logits.dtype), "rows_written": len(rows),
        **_cache_errors(cache, ref_cache, before, rows),
    }


# the default pair's target layers (dspark_trt/assets/default: d 512, 8 / 4 heads of 64, MLP 1408 =
# 11 x 128, tied head), two of them, a small vocabulary: one token and a verify block of 8
DEFAULT_DIMS_CASES = [("default_pair_dims_one_token", 1), ("default_pair_dims_verify_block_of_8", 8)]


def default_dims_pair():
    import dataclasses
    from tests.support.models import tiny_pair
    pair = tiny_pair(vocab=256, hidden=512, layers=2, heads=8, kv_heads=4, taps=(0,))
    target = dataclasses.replace(pair.target, intermediate_size=1408, head_dim=64, tie_word_embeddings=True)
    return dataclasses.replace(pair, target=target,
                               draft=dataclasses.replace(pair.draft, backbone=target)).validate()


# (name, layers, step tokens): deep enough that rounding errors compound (weights x 4)
DEEP_CASES = [("deep_one_token", 12, 1), ("deep_verify_block_of_8", 12, 8)]


def deep_cases() -> dict:
    """Per case of ``DEEP_CASES``: the chain's step and the module's, each against the same step in
    fp32 (weights, caches and arithmetic): their logits' largest error over the fp32 logits' scale
    (bf16 rounding compounds over the layers; the chain should not drift further than the modules)."""
    import copy
    from dspark_trt.models import build_models
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.runtime.token_step import TokenStep
    from tests.support.models import scale_weights_, tiny_pair
    out = {}
    for name, layers, T in DEEP_CASES:
        target, _ = build_models(tiny_pair(vocab=96, hidden=64, layers=layers, heads=4, kv_heads=2, taps=(0,)),
                                 torch.bfloat16, "cpu", seed=7)
        scale_weights_(target, 4.0)
        fuse_projections_(target)
        exact = copy.deepcopy(target).float()
        cache = target.make_cache(PAGES, PAGE, torch.bfloat16, "cpu")
        table, gen = torch.tensor(TABLES[:1]), torch.Generator().manual_seed(0)
        ids, tokens = torch.randint(0, 96, (1, 5), generator=gen), torch.randint(0, 96, (1, T), generator=gen)
        step_pos = 5 + torch.arange(T)[None]                  # within the table's 4 pages of 4
        with torch.inference_mode():
            target(ids, torch.arange(5)[None], table, cache)
            cache32 = {k: [c.float() for c in v] for k, v in cache.items()}
            module_cache = {k: [c.clone() for c in v] for k, v in cache.items()}
            ref = exact(tokens, step_pos, table, cache32)[0].float()
            module = target(tokens, step_pos, table, module_cache)[0].float()
            chain = TokenStep(target)(tokens, step_pos, cache, table)[0].float()
        err = lambda x: float((x - ref).abs().max() / ref.abs().max())          # noqa: E731
        out[name] = {"chain_fp32_err": err(chain), "module_fp32_err": err(module)}
    return out


if __name__ == "__main__":       # python -m tests.support.token_step_cases [llm] (TRITON_INTERPRET=1)
    assert os.environ.get("TRITON_INTERPRET") == "1"          # set before triton is imported
    print("RESULT " + json.dumps(llm_runs() if sys.argv[1:] == ["llm"] else step_cases()))
