"""Markov head, sampler formula, block layout, positions and masks against the spec."""
from __future__ import annotations

import torch

from dspark_trt import plugins
from dspark_trt.models import build_models
from dspark_trt.plugins.rng import STREAM_DRAFT, gumbel

from tests.support.models import tiny_pair


def test_markov_sample_equals_explicit_formula():
    g = torch.Generator().manual_seed(0)
    B, N, V, r = 3, 5, 40, 6
    U = torch.randn(B, N, V, generator=g, dtype=torch.float64)
    w1 = torch.randn(V, r, generator=g, dtype=torch.float64)
    w2 = torch.randn(V, r, generator=g, dtype=torch.float64)
    anchor = torch.tensor([3, 17, -1])
    temp = torch.tensor([0.0, 0.7, 1.0])
    seed, start = torch.tensor([5, 6, 7]), torch.tensor([10, 20, 30])
    tokens, z = plugins.markov_sample(U, anchor, w1, w2, temp, seed, start)
    for b in range(2):                                    # row 2 is inert
        prev = int(anchor[b])
        for k in range(N):
            zk = U[b, k] + sum(w2[:, j] * w1[prev, j] for j in range(r))    # W2 · W1[prev]
            assert torch.allclose(z[b, k].double(), zk, atol=1e-5)
            if temp[b] == 0:
                want = int(zk.argmax())
            else:
                noise = gumbel(seed[b:b + 1], start[b:b + 1] + k + 1, STREAM_DRAFT, V)[0].double()
                want = int((zk / temp[b] + noise).argmax())
            assert int(tokens[b, k]) == want
            prev = want
    assert tokens[2].tolist() == [-1] * N and bool((z[2] == 0).all())


def test_markov_sampler_draws_from_softmax_of_corrected_logits():
    """Frequencies of the first draft over many seeds follow softmax(z_0 / T) (chi-square, alpha 1e-3)."""
    from scipy.stats import chisquare
    g = torch.Generator().manual_seed(1)
    V, r, M, T = 8, 3, 4000, 0.9
    U = torch.randn(1, 1, V, generator=g).expand(M, 1, V).contiguous()
    w1, w2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g)
    tokens, z = plugins.markov_sample(U, torch.full((M,), 2), w1, w2, torch.full((M,), T),
                                      torch.arange(M), torch.zeros(M, dtype=torch.int64))
    p = torch.softmax(z[0, 0].double() / T, -1).numpy()
    counts = torch.bincount(tokens[:, 0], minlength=V).numpy()
    assert chisquare(counts, p * M).pvalue > 1e-3


def test_block_layout_positions_and_noncausal_mask(monkeypatch):
    """Block = [anchor, mask x (N-1)] at P..P+N-1, every query sees keys 0..P+N-1 (non-causal);
    context injection writes the draft KV at the context rows' own positions."""
    pair = tiny_pair(block=4)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    cache = draft.make_cache(8, 8, torch.float64, "cpu")
    calls = []
    real_attn, real_write = plugins.block_attention, plugins.kv_cache_write
    monkeypatch.setattr(plugins, "block_attention",
                        lambda *a: calls.append(("attn", a[4].clone(), a[5].clone())) or real_attn(*a))
    monkeypatch.setattr(plugins, "kv_cache_write",
                        lambda *a: calls.append(("write", a[5].clone())) or real_write(*a))
    embedded = []
    monkeypatch.setattr(draft.embed_tokens, "forward",
                        lambda t: embedded.append(t.clone()) or torch.nn.functional.embedding(t, draft.embed_tokens.weight))
    table = torch.tensor([[0, 1], [2, 3]])
    taps = torch.randn(2, 10, 2 * pair.target.hidden_size, dtype=torch.float64)
    ctx_pos = torch.tensor([list(range(10)), list(range(6)) + [-1] * 4])
    draft.context(taps, ctx_pos, table, cache)
    assert [c[0] for c in calls] == ["write"] * pair.draft.num_hidden_layers
    assert torch.equal(calls[0][1], ctx_pos)
    calls.clear()
    anchor, start = torch.tensor([7, 9]), torch.tensor([10, 6])
    draft.block(anchor, start, table, cache)
    mask = pair.draft.mask_token_id
    assert embedded[-1].tolist() == [[7, mask, mask, mask], [9, mask, mask, mask]]
    writes = [c for c in calls if c[0] == "write"]
    attn = [c for c in calls if c[0] == "attn"]
    assert torch.equal(writes[0][1], torch.tensor([[10, 11, 12, 13], [6, 7, 8, 9]]))
    assert torch.equal(attn[0][1], torch.tensor([[10, 11, 12, 13], [6, 7, 8, 9]]))
    assert torch.equal(attn[0][2], torch.tensor([[13] * 4, [9] * 4]))       # P + N - 1 for all queries


def test_block_query_zero_sees_later_block_positions():
    """Non-causal: draft row 0 changes when the block grows (later positions become visible),
    whereas the causal target's row 0 does not."""
    pair = tiny_pair(block=4)
    target, draft = build_models(pair, torch.float64, "cpu", seed=0)
    outs = []
    for n in (1, 4):
        cache = draft.make_cache(4, 8, torch.float64, "cpu")
        table = torch.tensor([[0, 1]])
        taps = torch.randn(1, 5, 2 * pair.target.hidden_size, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(0))
        draft.context(taps, torch.arange(5)[None], table, cache)
        outs.append(draft.block(torch.tensor([3]), torch.tensor([5]), table, cache, num_spec_tokens=n)[0, 0])
    assert not torch.allclose(outs[0], outs[1])


def test_top_p_keeps_exactly_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = plugins.apply_top_p(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.8, 0.81]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]     # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(out[1]).tolist() == [True, True, True, False]
    assert torch.equal(out[0, :2], logits[0, :2])
