"""Greedy speculative decoding must reproduce greedy target decoding token for token."""
from __future__ import annotations

import random

import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import scale_weights_, tiny_pair
from tests.support.draft_oracles import NearTargetNetworks


def _llm(block: int, seed: int, max_batch: int = 4, page_size: int = 8) -> LLM:
    pair = tiny_pair(block=block, rank=8 if seed % 2 else 0, layers=3 + seed % 2)
    target, draft = build_models(pair, torch.float64, "cpu", seed=seed)
    scale_weights_(target, 4.0)               # sharper target: long greedy runs are likely
    return LLM(pair, target, draft, max_batch_size=max_batch, max_seq_len=96, page_size=page_size)


def _prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab - 1) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("block", range(1, 9))
def test_greedy_speculative_equals_target_dspark_draft(block):
    llm = _llm(block, seed=block)
    rng = random.Random(block)
    prompts = _prompts(rng, 1 + block % 4, llm.pair.target.vocab_size)
    sp = SamplingParams(max_new_tokens=rng.randint(8, 30))
    spec = llm.generate(prompts, sp, speculative=True)
    ar = llm.generate(prompts, sp, speculative=False)
    for s, a in zip(spec, ar):
        assert s.output_ids == a.output_ids
        assert len(s.output_ids) == sp.max_new_tokens and s.finish_reason == "length"
        assert all(0 <= x <= block for x in s.stats.accepted)


@pytest.mark.parametrize("block,batch", [(1, 1), (3, 2), (5, 3), (8, 2)])
def test_greedy_speculative_equals_target_with_long_accepted_runs(block, batch):
    llm = _llm(block, seed=100 + block, max_batch=batch)
    rng = random.Random(block)
    prompts = _prompts(rng, batch + 1, llm.pair.target.vocab_size)   # one joins mid-run
    sp = SamplingParams(max_new_tokens=20)
    ar = llm.generate(prompts, sp, speculative=False)
    nets = NearTargetNetworks(llm.networks, sigma=0.5, seed=block)
    gen = Scheduler(nets, batch, llm.max_seq_len, llm.pair.target.vocab_size)
    spec = gen.run([(p, sp) for p in prompts])
    for s, a in zip(spec, ar):
        assert s.output_ids == a.output_ids
    accepted = [x for s in spec for x in s.stats.accepted]
    assert max(accepted) >= min(block, 4), "the near-target draft should get long runs accepted"
    assert min(accepted) < block, "and some rejections"


def test_stop_tokens_end_both_paths_identically():
    llm = _llm(4, seed=7)
    prompts = _prompts(random.Random(7), 3, llm.pair.target.vocab_size)
    free = llm.generate(prompts, SamplingParams(max_new_tokens=30), speculative=False)
    stop = free[0].output_ids[5]                     # a token the target does produce
    sp = SamplingParams(max_new_tokens=30, stop_token_ids=[stop])
    spec = llm.generate(prompts, sp, speculative=True)
    ar = llm.generate(prompts, sp, speculative=False)
    for s, a in zip(spec, ar):
        assert s.output_ids == a.output_ids
    first = spec[0].output_ids
    assert first[-1] == stop and stop not in first[:-1] and spec[0].finish_reason == "stop"


def test_temperature_outputs_are_reproducible_per_seed():
    llm = _llm(4, seed=3)
    p = [[1, 2, 3]]
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=11, max_new_tokens=20))[0]
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=11, max_new_tokens=20))[0]
    c = llm.generate(p, SamplingParams(temperature=1.0, seed=12, max_new_tokens=20))[0]
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def _near_target_run(llm, prompts, sp, seed):
    nets = NearTargetNetworks(llm.networks, sigma=0.5, seed=seed)
    return Scheduler(nets, len(prompts), llm.max_seq_len, llm.pair.target.vocab_size).run(
        [(p, sp) for p in prompts])


def test_round_cut_by_stop_token_counts_committed_tokens():
    """A stop token accepted mid-block ends the round there: that round's tau counts the tokens it
    committed (no bonus) and its proposal length is cut at the stop token (DeepSpec metrics_row)."""
    block = 6
    llm = _llm(block, seed=21)
    prompt = [[3, 1, 4, 1, 5]]
    free = _near_target_run(llm, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), seed=5)[0]
    # a round whose accepted drafts include a token not seen before: stop there, mid-block
    pos, stop = 1, None                               # output_ids[0] comes from prefill
    for a, c in zip(free.stats.accepted, free.stats.committed):
        fresh = [off for off in range(a - 1)          # an accepted draft with a later draft accepted
                 if free.output_ids[pos + off] not in free.output_ids[:pos + off]]
        if fresh:
            stop = free.output_ids[pos + fresh[0]]
            break
        pos += c
    assert stop is not None, "no mid-block accepted draft to stop at"
    out = _near_target_run(llm, prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[stop]), seed=5)[0]
    st = out.stats
    assert out.finish_reason == "stop" and out.output_ids[-1] == stop
    assert out.output_ids == free.output_ids[:len(out.output_ids)]
    assert sum(st.committed) == len(out.output_ids) - 1          # every committed token counted once
    assert st.committed[-1] == st.accepted[-1] == st.proposed[-1] < block + 1
    assert st.committed[-1] < free.stats.committed[st.rounds - 1]
    assert st.tau == pytest.approx((len(out.output_ids) - 1) / st.rounds)
    rates = st.acceptance_per_position()
    last = st.committed[-1]
    reached = [sum(p > k for p in st.proposed) for k in range(block)]
    assert reached[last] == st.rounds - 1                          # the cut round proposed no further
    assert rates == [sum(a > k for a in st.accepted) / r if r else 0.0 for k, r in enumerate(reached)]
