"""CUDA-graph replay of the decode steps == eager execution (GPU only; skipped on CPU)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from dspark_trt.runtime import LLM, SamplingParams
from dspark_trt.runtime.cuda_graphs import BACKENDS, GraphedSteps
from dspark_trt.runtime.steps import DecodeSteps, RoundInputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="CUDA graphs need a CUDA GPU")]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3], [5, 6]]
NEW = [24, 9, 30, 5, 17]


def backend_or_skip(backend: str) -> str:
    if backend == "cuda-python" and importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-python (cuda.bindings) is not installed")
    return backend


@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cuda",
                           max_batch_size=4, max_seq_len=96, page_size=16, cuda_graphs=False)


def caches(llm):
    return [t for c in (llm.networks.target_cache, llm.networks.draft_cache) for t in c["k"] + c["v"]]


def pad(r: RoundInputs, Bb: int) -> RoundInputs:
    inert = dict(anchor=-1, start=-1, seed=0, temperature=0, top_p=1, table=-1)
    return RoundInputs(**{f: np.concatenate([getattr(r, f), np.full(
        (Bb - r.batch_size, *getattr(r, f).shape[1:]), v, dtype=getattr(r, f).dtype)])
        for f, v in inert.items()})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_graph_rounds_equal_eager_rounds(llm, backend, sampled):
    """Same (padded) inputs: identical tokens / accept counts, same cache contents."""
    eager = DecodeSteps(llm.networks)
    graphed = GraphedSteps(eager, llm.max_batch_size, llm.max_pages_per_seq, backend_or_skip(backend))
    sp = SamplingParams(max_new_tokens=40, temperature=0.8 if sampled else 0.0,
                        top_p=0.9 if sampled else 1.0, seed=7, ignore_eos=True)
    gen = llm.scheduler()
    seqs = [gen.add_request(p, sp) for p in PROMPTS[:3]]
    gen.step()                                              # eager prefill of 3 rows (bucket 4)
    r = gen.round_inputs(seqs)
    for kind in ("spec", "ar"):
        saved = [t.clone() for t in caches(llm)]
        want = getattr(eager, f"{kind}_round")(pad(r, 4), sampled)[:3]
        want_caches = [t.clone() for t in caches(llm)]
        for t, s in zip(caches(llm), saved):
            t.copy_(s)
        for _ in range(2):                                  # replaying twice is idempotent here
            got = getattr(graphed, f"{kind}_round")(r, sampled)
        np.testing.assert_array_equal(got, want)
        for a, b in zip(caches(llm), want_caches):
            torch.testing.assert_close(a[:-1], b[:-1], rtol=1e-5, atol=1e-5)  # pad page excluded


def test_generate_with_graphs_equals_eager(llm):
    """Full runs with requests joining and leaving (buckets 4 -> 2 -> 1): same greedy tokens."""
    graphed = LLM(llm.pair, llm.target, llm.draft, max_batch_size=4, max_seq_len=96, page_size=16,
                  cuda_graphs=True)
    assert isinstance(graphed.steps, GraphedSteps) and graphed.graphs_skipped is None
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    for speculative in (True, False):
        want = llm.generate(PROMPTS, params, speculative=speculative)
        got = graphed.generate(PROMPTS, params, speculative=speculative)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        assert [o.stats.accepted for o in got] == [o.stats.accepted for o in want]
    assert {k[1] for k in graphed.steps._graphs} >= {1, 2, 4}


def test_generate_with_sampling_modifiers_through_graphs_equals_eager(llm):
    """top_k / min_p / top_p / penalties, greedy and sampled rows mixed, requests joining and
    leaving: the modifier graphs (the penalty ones update ``DecodeSteps.counts`` in place) give
    the eager tokens."""
    graphed = LLM(llm.pair, llm.target, llm.draft, max_batch_size=4, max_seq_len=96, page_size=16,
                  cuda_graphs=True)
    mods = [dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
            dict(top_k=5, min_p=0.05), {}, dict(repetition_penalty=1.5, top_p=0.9),
            dict(presence_penalty=-0.5, top_k=8)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8 if i % 2 else 0.0,
                             seed=i, **m) for i, (n, m) in enumerate(zip(NEW, mods))]
    for speculative in (True, False):
        want = llm.generate(PROMPTS, params, speculative=speculative)
        got = graphed.generate(PROMPTS, params, speculative=speculative)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert any(k[2].penalties for k in graphed.steps._graphs)


def test_replayed_round_allocates_no_device_memory(llm):
    graphed = GraphedSteps(DecodeSteps(llm.networks), 4, llm.max_pages_per_seq)
    gen = llm.scheduler()
    seqs = [gen.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in PROMPTS[:2]]
    gen.step()
    r = gen.round_inputs(seqs)
    graphed.spec_round(r, False)                           # captures bucket 2
    torch.cuda.synchronize()
    count = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        graphed.spec_round(r, False)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == count


@pytest.mark.parametrize("Bb", [1, 2, 3, 5, 8])
def test_bucket_inputs_are_16_byte_aligned(Bb):
    """AOTInductor engines assume 16-byte aligned inputs and copy a misaligned one on every call."""
    from dspark_trt.runtime.cuda_graphs import BucketBuffers
    x = BucketBuffers(Bb, max_pages=3, device="cuda").inputs
    for name in ("anchor", "start", "seed", "table", "temperature", "top_p", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "slot"):
        assert getattr(x, name).data_ptr() % 16 == 0, name

