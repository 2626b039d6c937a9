"""V4 attention: index lists, sparse attention vs dense references, non-causal draft block,
cache consistency under speculative rollback (float64, CPU)."""
import pytest
import torch
import torch.nn.functional as F

from dspark_trt import plugins
from dspark_trt.config import get_preset
from dspark_trt.models import build_models
from dspark_trt.models.deepseek_v4 import causal_window_rows
from dspark_trt.models.v4_layers import apply_rope_tail, rms, rope_cos_sin

TOL = 1e-10      # float64 throughout


@pytest.fixture(scope="module")
def tiny():
    pair = get_preset("deepseek-v4-tiny-dspark")
    target, draft = build_models(pair, dtype=torch.float64, seed=0)
    return pair, target, draft


# ---- index construction -------------------------------------------------------------------------

def test_noncausal_indices_worked_example():
    """Doc §9.3: W=8, N=4, seq 14, page 4, table [5, 2, 9, 7] -> positions 2..13, rest -1."""
    table = torch.tensor([[5, 2, 9, 7]])
    idx, lens = plugins.noncausal_swa_indices(torch.tensor([10]), table, 4, 4, 8, 128)
    row = [22, 23, 8, 9, 10, 11, 36, 37, 38, 39, 28, 29]
    assert idx.shape == (1, 4, 128) and lens.tolist() == [[12] * 4]
    for q in range(4):
        assert idx[0, q, :12].tolist() == row and (idx[0, q, 12:] == -1).all()
    inert, lens = plugins.noncausal_swa_indices(torch.tensor([-1]), table, 4, 4, 8, 128)
    assert (inert == -1).all() and (lens == 0).all()


def test_noncausal_indices_overflow_is_an_error():
    table = torch.zeros(1, 64, dtype=torch.int64)
    with pytest.raises(ValueError, match="more than the width"):
        plugins.noncausal_swa_indices(torch.tensor([200]), table, 8, 4, 128, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        plugins.noncausal_swa_indices(torch.tensor([20]), table, 4, 4, 8, 100)


# ---- sparse attention vs dense ------------------------------------------------------------------

def _dense_with_sink(q, k, mask, sink, scale):
    """q [T, H, D], k [S, D], mask [T, S] bool, sink [H] -> [T, H, D]; sink = a value-0 logit."""
    s = torch.einsum("thd,sd->ths", q, k) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat([s, sink[None, :, None].expand(q.shape[0], -1, 1).to(s.dtype)], -1)
    return torch.einsum("ths,sd->thd", s.softmax(-1)[..., :-1], k)


def test_sparse_attention_equals_dense_sdpa():
    g = torch.Generator().manual_seed(0)
    T, H, D, S = 6, 4, 32, 40
    q, kv = torch.randn(T, H, D, generator=g, dtype=torch.float64), torch.randn(S, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(S, generator=g)[:10] for _ in range(T)])
    idx[:, 7:] = -1
    idx[5] = -1                                              # a token with no entry -> 0
    mask = torch.zeros(T, S + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx, S), True)[:, :S]
    no_sink = torch.full((H,), float("-inf"))
    out = plugins.sparse_mla_attention(q[:5], kv, idx[:5].int(), no_sink, D ** -0.5, D)
    ref = F.scaled_dot_product_attention(q[:5].transpose(0, 1), kv[None].expand(H, S, D),
                                         kv[None].expand(H, S, D), attn_mask=mask[None, :5], scale=D ** -0.5)
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=TOL, rtol=0)
    sink = torch.randn(H, generator=g)
    out = plugins.sparse_mla_attention(q, kv, idx.int(), sink, D ** -0.5, D)
    torch.testing.assert_close(out[:5], _dense_with_sink(q[:5], kv, mask[:5], sink, D ** -0.5), atol=TOL, rtol=0)
    assert (out[5] == 0).all()


def test_noncausal_list_sees_later_block_tokens():
    """A dominant last block token moves query 0 under the non-causal list, not under a causal one."""
    g = torch.Generator().manual_seed(1)
    W, N, P, D, H = 8, 4, 10, 32, 2
    table = torch.arange(8)[None]
    idx, _ = plugins.noncausal_swa_indices(torch.tensor([P]), table, N, 4, W, 128)
    causal = torch.where(torch.arange(128) <= W, idx[0, 0], -1)[None]    # positions 2..10 only
    q = torch.randn(1, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(32, D, generator=g, dtype=torch.float64)
    sink = torch.zeros(H)
    loud = kv.clone()
    loud[P + N - 1] = 50 * q[0].mean(0)                                   # position 13
    run = lambda i, k: plugins.sparse_mla_attention(q, k, i[:1].int(), sink, D ** -0.5, D)
    assert (run(idx[0], loud) - run(idx[0], kv)).abs().max() > 1.0
    assert torch.equal(run(causal, loud), run(causal, kv))


def test_draft_block_is_noncausal_and_target_is_causal(tiny):
    pair, target, draft = tiny
    B, L = 1, 40
    table = torch.arange(4)[None]
    tc, dc = target.make_cache(4, 16, torch.float64, "cpu"), draft.make_cache(4, 16, torch.float64, "cpu")
    tokens = torch.randint(0, 500, (B, L), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(L)[None]
    logits, taps = target(tokens, pos, table, tc)
    draft.context(taps, pos, table, dc)
    anchor, start = torch.tensor([7]), torch.tensor([L])
    U5 = draft.block(anchor, start, table, dc)                   # N = the block size
    U1 = draft.block(anchor, start, table, dc, num_spec_tokens=1)
    assert (U5[:, 0] - U1[:, 0]).abs().max() > 1e-3          # row 0 sees the later noise tokens
    logits_prefix, _ = target(tokens[:, :25], pos[:, :25], table, target.make_cache(4, 16, torch.float64, "cpu"))
    torch.testing.assert_close(logits_prefix, logits[:, :25], atol=TOL, rtol=0)


# ---- whole layers vs a dense reference ------------------------------------------------------------

def _pool(comp, x, r, inv_freq):
    """Dense re-derivation of the compressed entries: per channel softmax over the block's tokens
    (ratio 4: the previous block through channels [:D] too), RMSNorm, RoPE at c*r."""
    D, T = comp.dim, x.shape[0]
    a, g = comp.wkv(x), comp.wgate(x)
    out = []
    for c in range(T // r):
        own = slice(c * r, (c + 1) * r)
        kv, sc = a[own, -D:], g[own, -D:] + comp.ape[:, -D:]
        if comp.overlap and c > 0:
            prev = slice((c - 1) * r, c * r)
            kv = torch.cat([a[prev, :D], kv])
            sc = torch.cat([g[prev, :D] + comp.ape[:, :D], sc])
        e = comp.norm((sc.softmax(0) * kv).sum(0))
        cos, sin = rope_cos_sin(torch.tensor(c * r), inv_freq, x.dtype)
        out.append(apply_rope_tail(e, cos, sin))
    return torch.stack(out) if out else x.new_zeros(0, D)


def _dense_layer(attn, x):
    cfg, T = attn.cfg, x.shape[0]
    H, D, G, W, r = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.sliding_window, attn.ratio
    p = torch.arange(T)
    cos, sin = rope_cos_sin(p, attn.inv_freq, x.dtype)
    qr = attn.q_norm(attn.wq_a(x))
    q = apply_rope_tail(rms(attn.wq_b(qr).view(T, H, D), cfg.rms_norm_eps), cos[:, None], sin[:, None])
    kv = apply_rope_tail(attn.kv_norm(attn.wkv(x)), cos, sin)
    keys, mask = kv, (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - W)
    if r:
        comp = _pool(attn.compressor, x, r, attn.inv_freq)
        c = torch.arange(comp.shape[0])
        visible = c[None, :] < ((p + 1) // r)[:, None]
        if attn.indexer is not None:
            ix = attn.indexer
            iq = apply_rope_tail(ix.wq_b(qr).view(T, ix.heads, ix.dim), cos[:, None], sin[:, None])
            ik = _pool(ix.compressor, x, r, attn.inv_freq)
            w = ix.weights_proj(x) * ix.dim ** -0.5 * ix.heads ** -0.5
            score = (torch.einsum("thd,cd->thc", iq, ik).relu() * w[..., None]).sum(1)
            score = score.masked_fill(~visible, float("-inf"))
            k = min(ix.topk, comp.shape[0])
            top = score.topk(k, -1)
            # relu scores tie at 0; rows whose k-th and (k+1)-th visible scores tie are ambiguous
            srt = score.sort(-1, descending=True).values
            tied = (srt[:, k - 1] == srt[:, k]) & (srt[:, k] > float("-inf")) if comp.shape[0] > k else None
            visible = torch.zeros_like(visible).scatter_(1, top.indices, True) & visible
            attn._tied_rows = tied
        keys, mask = torch.cat([kv, comp]), torch.cat([mask, visible], 1)
    o = _dense_with_sink(q, keys, mask, attn.attn_sink.double(), D ** -0.5)
    o = apply_rope_tail(o, cos[:, None], sin[:, None], inverse=True).reshape(T, G, -1)
    o = torch.einsum("tgi,gri->tgr", o, attn.wo_a.weight.view(G, cfg.o_lora_rank, -1))
    return attn.wo_b(o.flatten(1))


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["swa", "csa4", "hca16"])
def test_layer_equals_dense_reference(tiny, layer):
    _, target, _ = tiny
    attn = target.layers[layer].attn
    T, page = 70, 8
    x = torch.randn(T, target.config.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    table = torch.tensor([[7, 3, 0, 9, 1, 5, 2, 8, 4, 6]])               # scattered pages
    cache = attn.make_cache(10, page, torch.float64, "cpu")
    pos = torch.arange(T)[None]
    out = attn(x[None], pos, table, cache, causal_window_rows(table, pos, page, attn.cfg.sliding_window))
    ref = _dense_layer(attn, x)
    keep = torch.ones(T, dtype=torch.bool)
    if layer == 1:
        keep = ~attn._tied_rows
        assert keep.sum() > 0.75 * T
    torch.testing.assert_close(out[0][keep], ref[keep], atol=1e-9, rtol=0)


def test_partial_accepts_keep_every_cache_consistent(tiny):
    """Rounds of [committed..., rejected garbage] at varying accept counts, crossing window,
    ratio-4 and ratio-16 boundaries, give the one-pass logits for every committed row."""
    _, target, _ = tiny
    g = torch.Generator().manual_seed(4)
    L, N, page = 90, 5, 16
    tokens = torch.randint(0, 500, (1, L), generator=g)
    table = torch.tensor([[3, 0, 5, 1, 4, 2, 6]])
    ref, ref_taps = target(tokens, torch.arange(L)[None], table, target.make_cache(7, page, torch.float64, "cpu"))
    cache = target.make_cache(7, page, torch.float64, "cpu")
    P = 23
    target(tokens[:, :P], torch.arange(P)[None], table, cache)
    while P < L - 1:
        a = int(torch.randint(0, N + 1, (1,), generator=g))
        a = min(a, L - 1 - P)
        garbage = torch.randint(0, 500, (1, N - a), generator=g)
        verify = torch.cat([tokens[:, P:P + a + 1], garbage], 1)               # anchor + drafts
        logits, taps = target(verify, (P + torch.arange(N + 1))[None], table, cache)
        torch.testing.assert_close(logits[:, :a + 1], ref[:, P:P + a + 1], atol=1e-9, rtol=0)
        torch.testing.assert_close(taps[:, :a + 1], ref_taps[:, P:P + a + 1], atol=1e-9, rtol=0)
        P += a + 1
