"""Logprobs of the emitted tokens: the raw target distribution (``runtime/logprobs.py``).

Greedy speculative logprobs equal autoregressive ones and one full-sequence forward of the target
(float64 tiny models: agreement to 1e-9, the float32 log_softmax's rounding of float64 logits is
~1e-7 relative, so the tolerance is 1e-5 absolute); the top list is sorted and holds the chosen
token first at temperature 0; sampling settings do not change them (raw).
"""
from __future__ import annotations

import math

import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, GraphedSteps
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams

from tests.support.models import scale_weights_, tiny_pair

TOL = 1e-5


def _llm(block: int = 4, seed: int = 3, confidence: bool = False, graphs: bool = False) -> LLM:
    """``confidence``: a draft with a (spread) confidence head; ``graphs``: rounds through
    ``GraphedSteps`` with the CPU eager-replay backend (the graph path's static buffers)."""
    pair = tiny_pair(block=block)
    pair.draft.enable_confidence_head = confidence
    target, draft = build_models(pair, torch.float64, "cpu", seed=seed)
    scale_weights_(target, 4.0)
    if confidence:
        with torch.no_grad():
            draft.confidence_head.proj.weight.mul_(3.0)
            draft.confidence_head.proj.bias.fill_(0.5)
    llm = LLM(pair, target, draft, max_batch_size=3, max_seq_len=96, page_size=8)
    if graphs:
        llm.graphs_skipped, llm.graph_backend = None, EAGER_REPLAY
    return llm


def _direct(llm: LLM, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Raw logprobs [len(out), V] of one forward of the target over prompt + output (a fresh LLM
    over the same modules: its own caches)."""
    fresh = LLM(llm.pair, llm.target, llm.draft, max_batch_size=1, max_seq_len=96, page_size=8)
    seq = prompt + out
    tokens = torch.tensor([seq])
    positions = torch.arange(len(seq))[None]
    table = torch.arange(fresh.max_pages_per_seq)[None]
    logits, _ = fresh.networks.target(tokens, positions, table)
    lp = torch.log_softmax(logits[0].float(), -1)
    return lp[len(prompt) - 1: len(seq) - 1]


PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("block", [1, 4])
def test_greedy_speculative_logprobs_equal_ar_and_a_direct_forward(block):
    llm = _llm(block)
    sp = SamplingParams(max_new_tokens=20, logprobs=5)
    spec = llm.generate(PROMPTS, sp, speculative=True)
    ar = llm.generate(PROMPTS, sp, speculative=False)
    assert any(sum(o.stats.accepted) > 0 for o in spec), "no draft accepted: the windows went untested"
    for p, s, a in zip(PROMPTS, spec, ar):
        assert s.output_ids == a.output_ids and len(s.logprobs) == len(s.output_ids) == 20
        direct = _direct(llm, p, s.output_ids)
        for j, (es, ea) in enumerate(zip(s.logprobs, a.logprobs)):
            assert es.token_id == ea.token_id == s.output_ids[j]
            assert abs(es.logprob - ea.logprob) < TOL
            assert abs(es.logprob - direct[j, es.token_id].item()) < TOL
            assert [i for i, _ in es.top] == [i for i, _ in ea.top]
            vals = [v for _, v in es.top]
            assert vals == sorted(vals, reverse=True) and len(vals) == 5
            assert es.top[0][0] == es.token_id and es.top[0][1] == es.logprob   # greedy: the argmax
            assert all(abs(v - direct[j, i].item()) < TOL for i, v in es.top)
            assert es.logprob <= 0


@pytest.mark.parametrize("mode", ["threshold", "scheduled"])
def test_confidence_modes_logprobs_equal_ar(mode):
    """Rounds that verify an admitted prefix (bonus from row l) report the same logprobs."""
    llm = _llm(confidence=True)
    sp = SamplingParams(max_new_tokens=16, logprobs=2, verify_mode=mode)
    spec = llm.generate(PROMPTS, sp)
    ar = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16, logprobs=2), speculative=False)
    if mode == "threshold":          # (scheduled at this load may admit all: the plain steps)
        assert any(p < 4 for o in spec for p in o.stats.proposed), "every round admitted all drafts"
    for s_, a in zip(spec, ar):
        assert s_.output_ids == a.output_ids
        assert all(abs(x.logprob - y.logprob) < TOL and x.top[0][0] == x.token_id
                   for x, y in zip(s_.logprobs, a.logprobs))


def test_logprob_rows_beside_graph_rounds_eager_replay():
    """With ``GraphedSteps`` (CPU eager replay), a batch where some requests ask for logprobs runs
    the eager logprob rounds: the tokens equal the graphed run's, every request's own."""
    llm = _llm(graphs=True)
    assert isinstance(llm.steps, GraphedSteps)
    sp = SamplingParams(max_new_tokens=20)
    want = SamplingParams(max_new_tokens=20, logprobs=1)
    graphed = llm.generate(PROMPTS, sp)
    mixed = llm.generate(PROMPTS, [want, sp, want])
    assert [o.output_ids for o in mixed] == [o.output_ids for o in graphed]
    assert mixed[1].logprobs is None and len(mixed[0].logprobs) == len(mixed[0].output_ids)


def test_logprobs_are_raw_and_optional():
    """Penalties / temperature do not change a token's logprob (raw distribution); requests without
    ``logprobs`` get None; logprobs=0 gives the chosen token only."""
    llm = _llm()
    plain, zero = llm.generate([PROMPTS[0], PROMPTS[0]], [SamplingParams(max_new_tokens=8),
                                                          SamplingParams(max_new_tokens=8, logprobs=0)])
    assert plain.logprobs is None and all(e.top == [] for e in zero.logprobs)
    hot = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0.8, seed=1,
                                                  repetition_penalty=1.3, top_k=5, logprobs=2))[0]
    direct = _direct(llm, PROMPTS[0], hot.output_ids)
    for j, e in enumerate(hot.logprobs):
        assert abs(e.logprob - direct[j, e.token_id].item()) < TOL
    # the probabilities of the full distribution sum to 1 (the raw law, not a truncated one)
    assert math.isclose(sum(math.exp(v) for v in direct[0].tolist()), 1.0, rel_tol=1e-6)


def test_logprobs_out_of_range_is_refused():
    llm = _llm()
    for bad in (21, -1, 2.5):
        with pytest.raises(RequestError, match="logprobs must be an integer in \\[0, 20\\]"):
            llm.generate([1, 2], SamplingParams(logprobs=bad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="logprob rounds beside CUDA graphs need a CUDA GPU")
def test_logprob_rounds_beside_cuda_graph_rounds():
    """On CUDA with graphs: a batch where one request asks for logprobs runs eager rounds; its
    tokens equal the graphed run's, and its logprobs equal AR's (fp32, 1e-4: TF32-free kernels
    but other reduction orders) on the prefix where the greedy tokens agree."""
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cuda", max_batch_size=4,
                          max_seq_len=96, page_size=16, cuda_graphs=True)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=3)
    graphed = llm.generate(PROMPTS, sp)
    mixed = llm.generate(PROMPTS, [want, sp, want])
    ar = llm.generate(PROMPTS, want, speculative=False)
    assert [o.output_ids for o in mixed] == [o.output_ids for o in graphed]
    assert mixed[1].logprobs is None and len(mixed[0].logprobs) == 24
    for m, a in ((mixed[0], ar[0]), (mixed[2], ar[2])):
        for es, ea in zip(m.logprobs, a.logprobs):
            if es.token_id != ea.token_id:
                break
            assert abs(es.logprob - ea.logprob) < 1e-4
            assert es.top[0][0] == es.token_id
