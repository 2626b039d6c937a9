"""Admission prefill from graphs of padded shapes (``prefill_graphs.py``) == the eager prefill:
same first tokens and logits, the same target and draft KV at every prompt position, nothing
written for pad rows or pad tokens; on the CPU through the "eager-replay" backend (the padding and
static buffers), on a GPU through real captures."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.runtime import LLM, SamplingParams
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, GraphedSteps
from dspark_trt.runtime.prefill_graphs import PREFILL_MAX_TOKENS, length_bucket
from dspark_trt.runtime.steps import DecodeSteps

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]          # B = 3 (bucket 4), T = 20 (32)
PAGE = 8


def _backends():
    out = [pytest.param(EAGER_REPLAY, "cpu", torch.float64, id="cpu-eager-replay")]
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
    return out + [pytest.param("cuda-python", "cuda", torch.float32, id="cuda", marks=[pytest.mark.gpu, gpu])]


def _caches(llm):
    return [t for c in (llm.networks.target_cache, llm.networks.draft_cache) for t in c["k"] + c["v"]]


def _prefill(llm, steps, prompts):
    """Admit ``prompts`` on a scheduler over ``steps`` -> (sequences, K/V of every prompt position
    per cache tensor, all cache tensors after)."""
    gen = llm.scheduler()
    gen.steps = steps
    seqs = [gen.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
    gen.step()                                               # admission only: the prefill
    kv = [torch.stack([t[s.table_row[p // PAGE], p % PAGE] for s in seqs for p in range(len(s.prompt_ids))])
          for t in _caches(llm)]
    return seqs, kv, [t.clone() for t in _caches(llm)]


@pytest.mark.parametrize("backend,device,dtype", _backends())
def test_graphed_prefill_equals_eager_prefill(backend, device, dtype):
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=dtype, device=device, max_batch_size=4,
                          max_seq_len=64, page_size=PAGE, cuda_graphs=False)
    eager = DecodeSteps(llm.networks)
    graphed = GraphedSteps(eager, llm.max_batch_size, llm.max_pages_per_seq, backend)
    for t in _caches(llm):
        t.fill_(7.0)                                        # pages nobody owns keep this
    before = [t.clone() for t in _caches(llm)]
    want_seqs, want_kv, _ = _prefill(llm, eager, PROMPTS)
    for t, b in zip(_caches(llm), before):
        t.copy_(b)
    got_seqs, got_kv, after = _prefill(llm, graphed, PROMPTS)
    assert list(graphed.prefills._graphs) == [(4, 32, True, False)]     # B 3 -> 4, T 20 -> 32
    assert [s.output_ids for s in got_seqs] == [s.output_ids for s in want_seqs]
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for g, w in zip(got_kv, want_kv):
        torch.testing.assert_close(g, w, **tol)
    owned = {int(p) for s in got_seqs for p in s.table_row if p >= 0}
    for t, b in zip(after, before):     # pad rows / tokens wrote nothing (but the scratch page,
        others = [p for p in range(t.shape[0] - 1) if p not in owned]   # the last, as eagerly)
        assert torch.equal(t[others], b[others])


def test_graphed_prefill_keeps_the_prompts_taps():
    """``keep_taps`` (a prompt whose draft context waits, ``deferred_context.py``): the graph's
    last-row logits and the prompt's taps [B, T, m*d] equal the eager prefill's (fp64, padding
    cut off), and neither writes the draft's cache."""
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float64, device="cpu", max_batch_size=4,
                          max_seq_len=64, page_size=PAGE, cuda_graphs=False)
    eager = DecodeSteps(llm.networks)
    graphed = GraphedSteps(eager, llm.max_batch_size, llm.max_pages_per_seq, EAGER_REPLAY)
    B, T = len(PROMPTS), max(map(len, PROMPTS))
    tokens = torch.tensor([p + [0] * (T - len(p)) for p in PROMPTS])
    positions = torch.tensor([list(range(len(p))) + [-1] * (T - len(p)) for p in PROMPTS])
    table = torch.full((B, llm.max_pages_per_seq), -1)
    table[:, :3] = torch.arange(3 * B).view(B, 3)
    lens = torch.tensor([len(p) for p in PROMPTS])
    draft = [t.clone() for c in (llm.networks.draft_cache,) for t in c["k"] + c["v"]]
    want = eager.prefill(tokens, positions, table, lens, False, keep_taps=True)
    got = graphed.prefill(tokens, positions, table, lens, False, keep_taps=True)
    assert list(graphed.prefills._graphs) == [(4, 32, False, True)]
    assert got[1].shape == want[1].shape == (B, T, want[1].shape[-1])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(llm.networks.draft_cache["k"] + llm.networks.draft_cache["v"], draft))


def test_prefill_shapes_past_the_largest_graph_run_eagerly():
    llm = LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float64, device="cpu", max_batch_size=4,
                          max_seq_len=64, page_size=PAGE)
    graphed = GraphedSteps(DecodeSteps(llm.networks), 4, llm.max_pages_per_seq, EAGER_REPLAY)
    pages = llm.max_pages_per_seq
    assert graphed.prefills.shape(3, 20, pages) == (4, 32)
    assert graphed.prefills.shape(1, 1, pages) == (1, 16)
    assert graphed.prefills.shape(4, PREFILL_MAX_TOKENS, pages) is None      # 4 x 2048 tokens
    assert graphed.prefills.shape(1, 5000, pages) is None                    # no length bucket
    assert graphed.prefills.shape(1, 20, pages + 1) is None                  # another table width
    assert length_bucket(17) == 32 and length_bucket(10_000) is None
