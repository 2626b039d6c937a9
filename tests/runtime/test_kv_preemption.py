"""KV pages reserved as sequences grow; when they run short the latest sequence is preempted and
recomputed later. More requests than the cache holds at once must give, token for token, what
each gives alone (greedy float64, and seeded sampling with penalties: the sampler's randomness is
keyed by seed and position, so the recomputed sequence samples alike)."""
from __future__ import annotations

import random

import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY
from dspark_trt.runtime.kv_manager import KVCacheFull, PagedKVManager
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.models import scale_weights_, tiny_pair


def _llm(num_pages: int | None, max_batch: int = 4, graphs: bool = False) -> LLM:
    """``graphs``: rounds through ``GraphedSteps`` (CPU eager replay: the graph path's buffers)."""
    pair = tiny_pair(block=4)
    target, draft = build_models(pair, torch.float64, "cpu", seed=11)
    scale_weights_(target, 4.0)
    llm = LLM(pair, target, draft, max_batch_size=max_batch, max_seq_len=64, page_size=4,
              num_pages=num_pages)
    if graphs:
        llm.graphs_skipped, llm.graph_backend = None, EAGER_REPLAY
    return llm


def _requests(n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    out = []
    for i in range(n):
        prompt = [rng.randrange(60) for _ in range(rng.randint(3, 10))]
        sp = (SamplingParams(max_new_tokens=30, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.9, seed=100 + i,
                             repetition_penalty=1.2, presence_penalty=0.5))
        out.append((prompt, sp))
    return out


@pytest.mark.parametrize("speculative,graphs", [(True, False), (False, False), (True, True)])
def test_more_requests_than_fit_equal_each_alone(speculative, graphs):
    reqs = _requests(6)
    alone = _llm(None, max_batch=1)
    want = [alone.generate(p, sp, speculative=speculative)[0].output_ids for p, sp in reqs]
    # 24 pages of 4 tokens: one request's whole budget is up to 10 + 30 + 5 = 45 tokens (12 pages),
    # so at most two fit reserved up front; four start, then preemptions make room
    small = _llm(24, graphs=graphs)
    gen = small.scheduler(speculative)
    seqs = [gen.add_request(p, sp) for p, sp in reqs]
    streamed = {s.request_id: [] for s in seqs}
    for s in seqs:
        s.on_tokens = streamed[s.request_id].extend
    peak = 0
    while gen.has_work():
        gen.step()
        peak = max(peak, len(gen.running))
        assert len(gen.kv.free) + sum(len(p) for p in gen.kv.owned.values()) == 24   # no page lost
    assert gen.preemptions > 0 and peak >= 3
    for s, w in zip(seqs, want):
        assert s.output_ids == w and s.finish_reason == "length"
        assert streamed[s.request_id] == w                  # each token delivered once, in order
    assert len(gen.kv.free) == 24 and not gen.kv.owned


def test_grow_takes_pages_only_when_they_fit():
    kv = PagedKVManager(num_pages=5, page_size=4, max_pages_per_seq=4)
    assert kv.allocate(0, 5) == [0, 1]
    assert kv.grow(0, 8) == [] and kv.grow(0, 9) == [2] and kv.missing(0, 16) == 1
    kv.allocate(1, 8)
    with pytest.raises(KVCacheFull):
        kv.grow(0, 16)
    assert kv.owned[0] == [0, 1, 2] and kv.free == []


def test_released_pages_are_taken_again_in_order():
    kv = PagedKVManager(num_pages=6, page_size=4, max_pages_per_seq=4)
    assert kv.allocate(0, 12) == [0, 1, 2] and kv.allocate(1, 8) == [3, 4]
    kv.release(0)
    assert kv.allocate(2, 9) == [0, 1, 2] and kv.grow(1, 12) == [5] and kv.free == []


def test_taking_a_page_does_not_cost_the_whole_free_list():
    """A serving budget holds tens of thousands of pages and every decode round grows some
    sequences by one: 20,000 one-page grows with 500,000 pages free take well under a second (they
    copied the free list each time: about 0.6 ms a grow, 12 s in all, on this machine)."""
    import time
    kv = PagedKVManager(num_pages=500_000, page_size=1, max_pages_per_seq=500_000)
    kv.allocate(0, 1)
    t0 = time.perf_counter()
    for n in range(2, 20_002):
        kv.grow(0, n)
    assert time.perf_counter() - t0 < 2.0
    assert kv.owned[0] == list(range(20_001)) and len(kv.free) == 500_000 - 20_001
