"""With temperature > 0, speculative decoding must sample from the target's own distribution.

The exact joint law of the first three generated tokens is enumerated from the target (V = 12, so
12 + 144 forward passes). Speculative decoding then generates those tokens for M independent seeds
(one batch), and a chi-square goodness-of-fit test on the second and third tokens and on their
joint must not reject at significance level alpha = 0.001 (expected cells < 5 are pooled). The same
test must reject a deliberately broken verifier that accepts every draft — so it has power. A draft
over half the vocabulary (``--draft-vocab``) must pass it too.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dspark_trt import plugins
from dspark_trt.models import build_models
from dspark_trt.models.draft_vocab import restrict_draft_vocab_
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import scale_weights_, tiny_pair
from tests.support.draft_oracles import NearTargetNetworks
from tests.support.stats import ALPHA, gof_pvalue

V, PROMPT, M, T = 12, [3, 1, 4, 1, 5], 3000, 0.8


@pytest.fixture(scope="module")
def llm():
    pair = tiny_pair(vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, block=3, rank=4, taps=(0,))
    target, draft = build_models(pair, torch.float64, "cpu", seed=5)
    scale_weights_(target, 3.0)
    return LLM(pair, target, draft, max_batch_size=M, max_seq_len=16, page_size=16)


def exact_law(llm) -> np.ndarray:
    """p(t1, t2, t3 | prompt) at temperature T: [V, V, V]."""
    tm = llm.target

    def next_probs(seqs: list[list[int]]) -> torch.Tensor:
        cache = tm.make_cache(len(seqs), 16, torch.float64, "cpu")
        toks = torch.tensor(seqs)
        pos = torch.arange(toks.shape[1]).expand_as(toks)
        logits, _ = tm(toks, pos, torch.arange(len(seqs))[:, None], cache)
        return torch.softmax(logits[:, -1] / T, -1)

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(V)])                               # [V, V]
    p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def sample_tokens(llm, networks=None) -> np.ndarray:
    gen = Scheduler(networks or llm.networks, M, llm.max_seq_len, V)
    outs = gen.run([(PROMPT, SamplingParams(temperature=T, seed=s, max_new_tokens=3)) for s in range(M)])
    return np.array([o.output_ids for o in outs])                                   # [M, 3]


def marginal_pvalues(tokens: np.ndarray, law: np.ndarray) -> dict[str, float]:
    c2 = np.bincount(tokens[:, 1], minlength=V)
    c3 = np.bincount(tokens[:, 2], minlength=V)
    c23 = np.bincount(tokens[:, 1] * V + tokens[:, 2], minlength=V * V)
    return {"t2": gof_pvalue(c2, law.sum((0, 2))), "t3": gof_pvalue(c3, law.sum((0, 1))),
            "t2t3": gof_pvalue(c23, law.sum(0))}


@pytest.mark.parametrize("draft", ["dspark", "near_target"])
def test_speculative_sampling_matches_target_distribution(llm, draft):
    law = exact_law(llm)
    nets = NearTargetNetworks(llm.networks, sigma=1.0, seed=1) if draft == "near_target" else None
    if nets is not None:
        tokens = sample_tokens(llm, nets)
    else:
        tokens = sample_tokens(llm)
    pvals = marginal_pvalues(tokens, law)
    assert min(pvals.values()) > ALPHA, pvals


def _half_vocab_llm(llm) -> LLM:
    draft = copy.deepcopy(llm.draft)
    draft.lm_head = llm.draft.lm_head
    restrict_draft_vocab_(draft, torch.tensor([0, 2, 3, 5, 7, 11]))
    return LLM(llm.pair, llm.target, draft, max_batch_size=M, max_seq_len=16, page_size=16)


def test_a_draft_vocabulary_keeps_the_target_distribution(llm):
    """The draft proposes only half the tokens (q = 0 elsewhere, ``models/draft_vocab.py``): the
    verifier's residual must give the others their whole mass."""
    pvals = marginal_pvalues(sample_tokens(_half_vocab_llm(llm)), exact_law(llm))
    assert min(pvals.values()) > ALPHA, pvals


def test_a_draft_vocabulary_that_misstates_q_is_detected(llm, monkeypatch):
    """Logits 0 instead of -inf outside the set (q > 0 where nothing was sampled): rejected."""
    from dspark_trt.models.draft_vocab import DraftVocab
    to_full = DraftVocab.to_full

    def zero_outside(self, drafts, z, anchor, z_out=None):
        tokens, full = to_full(self, drafts, z, anchor, z_out)
        return tokens, full.nan_to_num(neginf=0.0)

    monkeypatch.setattr(DraftVocab, "to_full", zero_outside)
    pvals = marginal_pvalues(sample_tokens(_half_vocab_llm(llm)), exact_law(llm))
    assert min(pvals.values()) < ALPHA, pvals


def test_broken_verifier_is_detected(llm, monkeypatch):
    """Accepting every draft samples the draft's law, not the target's: the test must reject."""
    law = exact_law(llm)

    def accept_all(logits, drafts, z, temperature, seed, start):
        acc, nxt = plugins.rejection_sample(logits, drafts, z, temperature, seed, start)
        n = drafts.shape[1]
        full = torch.full_like(acc, n)
        bonus = plugins.sample_tokens(logits[:, n], temperature, seed, start + n + 1)
        return full, bonus

    monkeypatch.setattr(llm.networks, "verify", accept_all)
    pvals = marginal_pvalues(sample_tokens(llm), law)
    assert min(pvals.values()) < ALPHA, pvals


@pytest.fixture(scope="module")
def llm_conf():
    """The same pair with a confidence head whose confidences spread over (0, 1), and a cost curve
    (latency = 3000 + verified tokens) under which a batch of M rows admits about half the drafts
    with the "packed" cost model (the default "padded" one admits all: the verify runs N drafts)."""
    from dspark_trt.runtime.cost_curve import CostCurve
    pair = tiny_pair(vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, block=3, rank=4, taps=(0,))
    pair.draft.enable_confidence_head = True
    target, draft = build_models(pair, torch.float64, "cpu", seed=5)
    scale_weights_(target, 3.0)
    with torch.no_grad():
        draft.confidence_head.proj.weight.mul_(4.0)
        draft.confidence_head.proj.bias.fill_(2.0)
    llm = LLM(pair, target, draft, max_batch_size=M, max_seq_len=16, page_size=16,
              verify_cost=CostCurve([1, 12000], [3001.0, 15000.0], "test"))
    llm.steps.scheduler.cost_model = "packed"
    return llm


@pytest.mark.parametrize("mode,cost_model", [("scheduled", "packed"), ("threshold", "packed"),
                                             ("scheduled", "trimmed"), ("scheduled", "fallback"),
                                             ("scheduled", "window")])
def test_confidence_modes_sample_the_target_distribution(llm_conf, mode, cost_model):
    """Verifying only an admitted prefix (Algorithm 1 across the batch, or the per-step threshold)
    keeps every token's law the target's; the rounds did verify varying numbers of drafts. With the
    "trimmed" cost model (3000 rows: a wider window costs 3000 tokens) the verify runs a window
    narrower than N = 3 (the target over [anchor, x_0 .. x_{w-1}] only), each row's l = w. With
    "fallback" (trimmed, and step costs under which drafting never pays) the second round is the
    AR fallback's round (0 drafts verified, the draft's context written). With "window" (trimmed,
    step costs under which AR never pays) the rounds after the first are window rounds: the
    fixed round of the estimate's w < N drafts, no head and no admission."""
    from dspark_trt.runtime.cost_curve import CostCurve
    law = exact_law(llm_conf)
    sched = llm_conf.steps.scheduler
    cost = sched.cost
    if cost_model in ("fallback", "window"):
        steps = dict(draft_ms=[1e5, 1e5], ar_ms=[1.0, 1.0]) if cost_model == "fallback" else \
            dict(draft_ms=[1.0, 1.0], ar_ms=[1e6, 1e6])
        sched.cost = CostCurve(cost.tokens, cost.latency_ms, f"test: {cost_model}", rows=[1, M], **steps)
    sched.cost_model = "trimmed" if cost_model in ("fallback", "window") else cost_model
    llm_conf.steps.verify_widths.clear()
    llm_conf.steps.window_rounds.clear()
    gen = Scheduler(llm_conf.networks, M, llm_conf.max_seq_len, V, steps=llm_conf.steps)
    outs = gen.run([(PROMPT, SamplingParams(temperature=T, seed=s, max_new_tokens=3, verify_mode=mode,
                                            confidence_threshold=0.6)) for s in range(M)])
    sched.cost_model, sched.cost = "packed", cost
    proposed = [p for o in outs for p in o.stats.proposed]
    if cost_model == "packed":
        assert {0, 2, 3} <= set(proposed), sorted(set(proposed))
    elif cost_model == "fallback":            # every second round (rows not done after one) is AR
        second = [o.stats.proposed[1] for o in outs if len(o.stats.proposed) > 1]
        assert len(second) > M // 10 and set(second) == {0}, sorted(set(second))
    elif cost_model == "window":              # the second round of rows not done after one
        second = [o.stats.proposed[1] for o in outs if len(o.stats.proposed) > 1]
        assert llm_conf.steps.window_rounds and len(second) > M // 10, llm_conf.steps.window_rounds
        assert max(second) < 3 and max(llm_conf.steps.window_rounds) < 3, sorted(set(second))
    else:
        widths = llm_conf.steps.verify_widths
        assert widths and max(widths) < 3, widths                       # trimmed windows ran
        assert max(proposed) <= max(widths), (sorted(set(proposed)), widths)
    pvals = marginal_pvalues(np.array([o.output_ids for o in outs]), law)
    assert min(pvals.values()) > ALPHA, pvals
