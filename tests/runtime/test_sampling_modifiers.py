"""vLLM-style modifiers of the target distribution (top_k, min_p, presence / frequency / repetition
penalties): the modified logits equal a plain reference of vLLM's semantics (in-block draft counts
included), greedy speculative output equals greedy AR output, sampled speculative tokens follow
the modified target law (chi-square goodness of fit at significance ALPHA = 1e-3, with power
against the unmodified law), and bad values are refused naming the field."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, GraphedSteps
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_modifiers import Modifiers, TokenCounts, apply_modifiers
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams
from dspark_trt.runtime.steps import DecodeSteps, DeviceInputs

from tests.support.models import scale_weights_, tiny_pair
from tests.support.draft_oracles import NearTargetNetworks
from tests.support.stats import ALPHA, gof_pvalue

PENALTIES = dict(presence_penalty=1.2, frequency_penalty=0.7, repetition_penalty=1.6)
CASES = {"presence": dict(presence_penalty=1.5), "negative_presence": dict(presence_penalty=-1.5),
         "frequency": dict(frequency_penalty=0.8), "repetition": dict(repetition_penalty=1.8),
         "top_k_min_p": dict(top_k=3, min_p=0.2),
         "all": dict(PENALTIES, top_k=5, min_p=0.05, top_p=0.9)}


# ---- the reference: vLLM's semantics, one row at a time, in float64 -------------------------------
def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams
                     ) -> torch.Tensor:
    """logits [V] of the token after prompt + output -> vLLM's modified logits: penalties (repetition
    over prompt + output, then frequency and presence over the output), then at temperature T
    min_p (probabilities), top_k (ties kept), top_p."""
    V = logits.shape[-1]
    lg = logits.double().clone()
    count = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).double()
    seen = count > 0
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[prompt] = True
    rep = torch.where(in_prompt | seen, sp.repetition_penalty, 1.0).double()
    lg = torch.where(lg > 0, lg / rep, lg * rep)
    lg = lg - sp.frequency_penalty * count - sp.presence_penalty * seen.double()
    t = sp.temperature or 1.0
    if sp.min_p > 0:
        probs = torch.softmax(lg / t, -1)
        lg = lg.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
    if sp.top_k > 0:
        lg = lg.masked_fill(lg < lg.sort(descending=True).values[min(sp.top_k, V) - 1], float("-inf"))
    if sp.top_p < 1:
        sp_sorted, order = torch.softmax(lg / t, -1).sort(descending=True)
        keep = torch.zeros(V, dtype=torch.bool)
        keep[order] = (sp_sorted.cumsum(-1) - sp_sorted) < sp.top_p
        lg = lg.masked_fill(~keep, float("-inf"))
    return lg


def device_inputs(params: list[SamplingParams], slots: list[int]) -> DeviceInputs:
    col = lambda f, dt=torch.float32: torch.tensor([getattr(p, f) for p in params], dtype=dt)  # noqa: E731
    B = len(params)
    return DeviceInputs(anchor=torch.zeros(B, dtype=torch.long), start=torch.zeros(B, dtype=torch.long),
                        seed=torch.zeros(B, dtype=torch.long), temperature=col("temperature"),
                        top_p=col("top_p"), table=torch.zeros(B, 1, dtype=torch.long),
                        top_k=col("top_k", torch.long), min_p=col("min_p"),
                        presence_penalty=col("presence_penalty"),
                        frequency_penalty=col("frequency_penalty"),
                        repetition_penalty=col("repetition_penalty"),
                        slot=torch.tensor(slots, dtype=torch.long))


def test_modified_logits_equal_the_vllm_reference_with_in_block_counts():
    """Hand-made rows: committed outputs, prompts and a drafted block with repeated tokens (also
    of committed / prompt tokens); row j of the window counts the drafts before it."""
    V, W = 10, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, W, V, generator=g) * 3                   # both signs
    prompts = [[1, 2, 2, 9], [0], [4, 5]]
    committed = [[3, 1, 3], [7], []]                                 # anchor included
    block = torch.tensor([[3, 3, 5], [7, 1, 7], [4, 6, 4]])          # [B, W-1] drafts
    params = [SamplingParams(temperature=0.7, **PENALTIES, top_k=6, min_p=0.02, top_p=0.95),
              SamplingParams(temperature=0.0, presence_penalty=-0.5, frequency_penalty=1.5,
                             repetition_penalty=0.8, top_k=-1, min_p=0.3),
              SamplingParams(temperature=1.3, repetition_penalty=2.0, top_k=2)]
    slots = [2, 0, 1]                                                # rows of the counts
    counts = TokenCounts(3, V, "cpu")
    for s, p, c in zip(slots, prompts, committed):
        counts.reset(s, p)
        if c:
            counts.add(torch.tensor([s]), torch.tensor([c]), torch.ones(1, len(c), dtype=torch.bool))
    x = device_inputs(params, slots)
    out = apply_modifiers(logits, x, Modifiers(True, True, True, True), counts, block)
    for b in range(3):
        for j in range(W):
            want = reference_logits(logits[b, j], prompts[b], committed[b] + block[b, :j].tolist(), params[b])
            got = out[b, j].double()
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (b, j, got, want)
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_neutral_modifiers_leave_the_logits_unchanged():
    V = 16
    logits = torch.randn(2, 3, V, dtype=torch.float64)
    counts = TokenCounts(2, V, "cpu")
    counts.reset(0, [1, 2, 3])
    counts.add(torch.tensor([0, 1]), torch.tensor([[4, 5], [6, 6]]), torch.ones(2, 2, dtype=torch.bool))
    x = device_inputs([SamplingParams(temperature=0.8), SamplingParams()], [0, 1])
    block = torch.tensor([[4, 4], [1, 2]])
    assert torch.equal(apply_modifiers(logits, x, Modifiers(True, True, True, True), counts, block), logits)


# ---- greedy: speculative == autoregressive -----------------------------------------------------------
def _llm(block: int, seed: int, max_batch: int = 4) -> LLM:
    pair = tiny_pair(block=block, rank=8 if seed % 2 else 0, layers=3)
    target, draft = build_models(pair, torch.float64, "cpu", seed=seed)
    scale_weights_(target, 4.0)
    return LLM(pair, target, draft, max_batch_size=max_batch, max_seq_len=64, page_size=8)


def _prompts(seed: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 1) for _ in range(rng.randint(1, 10))] for _ in range(n)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speculative_equals_greedy_ar(case):
    """Both drafts (the DSpark draft, and a near-target one whose long accepted runs make the
    in-block counts matter); 6 prompts through 3 slots (slots are reused); the modifiers change
    the output (the comparison is not vacuous for the penalties)."""
    llm = _llm(4, seed=11)
    prompts = _prompts(3, 6, llm.pair.target.vocab_size)
    sp = SamplingParams(max_new_tokens=24, **CASES[case])
    ar = llm.generate(prompts, sp, speculative=False)
    spec = llm.generate(prompts, sp, speculative=True)
    nets = NearTargetNetworks(llm.networks, sigma=0.3, seed=1)
    near = Scheduler(nets, 3, llm.max_seq_len, llm.pair.target.vocab_size).run([(p, sp) for p in prompts])
    for a, s, n in zip(ar, spec, near):
        assert s.output_ids == a.output_ids and n.output_ids == a.output_ids
    assert max(x for o in near for x in o.stats.accepted) >= 3
    if case != "top_k_min_p":                      # greedy: top-k / min-p keep the argmax
        plain = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
        assert any(p.output_ids != a.output_ids for p, a in zip(plain, ar))


@pytest.mark.parametrize("mode", ["threshold", "scheduled"])
def test_greedy_confidence_modes_with_penalties_equal_greedy_ar(mode):
    """Verifying an admitted prefix (the bonus from row l) counts the same committed tokens."""
    pair = tiny_pair(block=4, rank=8, layers=3)
    pair.draft.enable_confidence_head = True
    target, draft = build_models(pair, torch.float64, "cpu", seed=6)
    scale_weights_(target, 4.0)
    llm = LLM(pair, target, draft, max_batch_size=3, max_seq_len=64, page_size=8)
    prompts = _prompts(8, 4, pair.target.vocab_size)
    sp = SamplingParams(max_new_tokens=20, verify_mode=mode, confidence_threshold=0.5, **PENALTIES)
    spec, ar = llm.generate(prompts, sp), llm.generate(prompts, sp, speculative=False)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    assert any(p < 4 for o in spec for p in o.stats.proposed)      # some rounds verified a prefix


def test_mixed_batch_rows_equal_their_solo_runs_and_graph_buffers_equal_eager():
    """Rows with and without modifiers share rounds; each row's output is the one it gets alone,
    and the static-buffer path (GraphedSteps, eager replay) gives the same tokens, sampled too."""
    llm = _llm(3, seed=4, max_batch=3)
    prompts = _prompts(5, 5, llm.pair.target.vocab_size)
    params = [SamplingParams(max_new_tokens=16, temperature=t, seed=i, **kw) for i, (t, kw) in enumerate(
        [(0.0, CASES["all"]), (0.0, {}), (0.9, PENALTIES), (0.0, dict(repetition_penalty=1.5)),
         (1.0, dict(top_k=4, min_p=0.1))])]
    both = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, both):
        assert llm.generate([p], sp)[0].output_ids == o.output_ids
    graphed = GraphedSteps(DecodeSteps(llm.networks), 3, llm.max_pages_per_seq, EAGER_REPLAY)
    for speculative in (True, False):
        gen = Scheduler(llm.networks, 3, llm.max_seq_len, llm.pair.target.vocab_size,
                        speculative=speculative, steps=graphed)
        want = both if speculative else llm.generate(prompts, params, speculative=False)
        assert [o.output_ids for o in gen.run(list(zip(prompts, params)))] == [o.output_ids for o in want]


@pytest.mark.parametrize("graphs", [False, True])
def test_device_token_counts_follow_the_committed_output(graphs):
    """While a request runs, its slot's counts are its output's (the verify step adds the accepted
    drafts and the next token on the device) and the prompt mask its prompt's."""
    llm = _llm(4, seed=2, max_batch=2)
    steps = (GraphedSteps(DecodeSteps(llm.networks), 2, llm.max_pages_per_seq, EAGER_REPLAY)
             if graphs else DecodeSteps(llm.networks))
    gen = Scheduler(llm.networks, 2, llm.max_seq_len, llm.pair.target.vocab_size, steps=steps)
    prompts = _prompts(1, 2, llm.pair.target.vocab_size)
    seqs = [gen.add_request(p, SamplingParams(max_new_tokens=40, temperature=0.8, seed=i, **PENALTIES))
            for i, p in enumerate(prompts)]
    V, counts = llm.pair.target.vocab_size, None
    for _ in range(4):
        gen.step()
        counts = steps.eager.counts
        for s in seqs:
            assert s.finish_reason is None
            want = np.bincount(s.output_ids, minlength=V)
            assert np.array_equal(counts.output[s.slot].numpy(), want)
            assert set(torch.nonzero(counts.prompt[s.slot])[:, 0].tolist()) == set(s.prompt_ids)


def test_rounds_without_modifiers_run_the_plain_graphs():
    """The graph key: plain rounds replay the graphs they always did; penalty rounds get their own."""
    llm = _llm(3, seed=4, max_batch=2)
    graphed = GraphedSteps(DecodeSteps(llm.networks), 2, llm.max_pages_per_seq, EAGER_REPLAY)
    gen = Scheduler(llm.networks, 2, llm.max_seq_len, llm.pair.target.vocab_size, steps=graphed)
    gen.run([([1, 2, 3], SamplingParams(max_new_tokens=6))])
    assert {k[2] for k in graphed._graphs} == {Modifiers()}
    gen.run([([1, 2, 3], SamplingParams(max_new_tokens=6, presence_penalty=1.0))])
    assert {k[2] for k in graphed._graphs} == {Modifiers(), Modifiers(penalties=True)}


# ---- sampled: the speculative tokens follow the modified target law ---------------------------------
V, PROMPT, M, T = 12, [3, 1, 4, 1, 5], 3000, 0.8


@pytest.fixture(scope="module")
def small_llm():
    pair = tiny_pair(vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, block=3, rank=4, taps=(0,))
    target, draft = build_models(pair, torch.float64, "cpu", seed=5)
    scale_weights_(target, 3.0)
    return LLM(pair, target, draft, max_batch_size=M, max_seq_len=16, page_size=16)


def modified_law(llm, sp: SamplingParams) -> np.ndarray:
    """p(t1, t2, t3 | PROMPT) under the reference's modified distribution at T: [V, V, V]."""
    tm = llm.target

    def probs(outputs: list[list[int]]) -> torch.Tensor:
        seqs = [PROMPT + o for o in outputs]
        cache = tm.make_cache(len(seqs), 16, torch.float64, "cpu")
        toks = torch.tensor(seqs)
        pos = torch.arange(toks.shape[1]).expand_as(toks)
        logits, _ = tm(toks, pos, torch.arange(len(seqs))[:, None], cache)
        return torch.stack([torch.softmax(reference_logits(row, PROMPT, o, sp) / T, -1)
                            for row, o in zip(logits[:, -1], outputs)])

    p1 = probs([[]])[0]
    p2 = probs([[a] for a in range(V)])                                              # [V, V]
    p3 = probs([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def gof(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square p-value over the cells the law can reach (1 when it reaches one only); a
    sample in a cell of probability 0 (a masked token) gives 0."""
    zero = probs.ravel() == 0
    if counts.ravel()[zero].any():
        return 0.0
    return gof_pvalue(counts.ravel()[~zero], probs.ravel()[~zero]) if (~zero).sum() > 1 else 1.0


def pvalues(tokens: np.ndarray, law: np.ndarray) -> dict[str, float]:
    """p-values of the first three tokens' marginals and of the (t2, t3) joint."""
    return {"t1": gof(np.bincount(tokens[:, 0], minlength=V), law.sum((1, 2))),
            "t2": gof(np.bincount(tokens[:, 1], minlength=V), law.sum((0, 2))),
            "t3": gof(np.bincount(tokens[:, 2], minlength=V), law.sum((0, 1))),
            "t2t3": gof(np.bincount(tokens[:, 1] * V + tokens[:, 2], minlength=V * V), law.sum(0))}


def sample(llm, sp: SamplingParams, networks=None) -> np.ndarray:
    gen = Scheduler(networks or llm.networks, M, llm.max_seq_len, V)
    outs = gen.run([(PROMPT, dataclasses.replace(sp, seed=s)) for s in range(M)])
    return np.array([o.output_ids for o in outs])                                  # [M, 3]


DIST_CASES = {"penalties": dict(presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.8),
              "top_k_min_p": dict(top_k=4, min_p=0.1),
              "all": dict(presence_penalty=-0.8, repetition_penalty=1.5, top_k=6, min_p=0.05, top_p=0.9)}


@pytest.mark.parametrize("draft", ["dspark", "near_target"])
@pytest.mark.parametrize("case", list(DIST_CASES))
def test_speculative_sampling_follows_the_modified_target_law(small_llm, case, draft):
    sp = SamplingParams(temperature=T, max_new_tokens=3, **DIST_CASES[case])
    law = modified_law(small_llm, sp)
    nets = NearTargetNetworks(small_llm.networks, sigma=1.0, seed=1) if draft == "near_target" else None
    tokens = sample(small_llm, sp, nets)
    pv = pvalues(tokens, law)
    assert min(pv.values()) > ALPHA, pv
    # power: the unmodified target law is rejected
    plain = modified_law(small_llm, SamplingParams(temperature=T))
    assert min(pvalues(tokens, plain).values()) < ALPHA


# ---- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("top_k", -2), ("top_k", 2.5), ("top_k", True), ("min_p", -0.1), ("min_p", 1.01),
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -2.01),
    ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("max_tokens", 0)])
def test_bad_values_are_refused_naming_the_field(field, value):
    name = "max_new_tokens" if field == "max_tokens" else field
    with pytest.raises(RequestError, match=name):
        SamplingParams(**{field: value}).validate()


def test_neutral_and_edge_values_are_valid_and_max_tokens_is_an_alias():
    for kw in (dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(min_p=1.0), dict(presence_penalty=-2),
               dict(frequency_penalty=2), dict(repetition_penalty=0.5)):
        SamplingParams(**kw).validate()
    sp = SamplingParams(max_tokens=7)
    assert sp.max_new_tokens == 7 and sp.max_tokens == 7
    sp.max_tokens = 9
    assert sp.max_new_tokens == 9
    assert Modifiers.for_params([SamplingParams(top_k=0), SamplingParams()]) == Modifiers()


# ---- the OpenAI protocol ----------------------------------------------------------------------------
def test_openai_protocol_passes_the_fields_and_refuses_bad_values():
    pytest.importorskip("fastapi")
    from dspark_trt.openai_server.errors import APIError
    from dspark_trt.openai_server.protocol import parse_chat, parse_completion
    body = {"model": "m", "prompt": "hi", "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.2, "max_tokens": 3}
    p = parse_completion(body, "m").params
    assert (p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        5, 0.1, 0.5, -0.5, 1.2)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": -1}, "m")
    assert chat.params.top_k == -1 and chat.params.repetition_penalty == 1.0
    for field, value in [("top_k", -3), ("top_k", 1.5), ("min_p", 2), ("presence_penalty", 3),
                         ("frequency_penalty", "a"), ("repetition_penalty", 0), ("logprobs", 21),
                         ("logit_bias", {"1": 2})]:
        with pytest.raises(APIError) as e:
            parse_completion({**body, field: value}, "m")
        assert e.value.status == 400 and e.value.param == field
