"""The training forwards compute what the runtime computes, and the DSpark training mask is the
spec's (algorithm doc §2.5)."""
import dataclasses

import pytest
import torch

from dspark_trt.train.dense import block_attention_mask, causal_lm_forward, draft_block_logits
from dspark_trt.train.modules import build_block_draft, build_target
from dspark_trt.train.recipe import get_recipe


def test_block_mask_worked_example():
    # T = 6 context rows, blocks of N = 3 anchored at a = 1 and a = 4.
    # Block 0 sees context {0} and its own rows; block 1 sees context {0,1,2,3} and its own rows.
    expected = ["100000" "111000"] * 3 + ["111100" "000111"] * 3
    got = block_attention_mask(torch.tensor([[1, 4]]), context_len=6, block_size=3)[0]
    assert ["".join(str(int(v)) for v in row) for row in got.tolist()] == expected


def test_block_mask_general_rule():
    anchors = torch.tensor([[0, 5, 9], [3, 4, 11]])
    T, N = 12, 4
    m = block_attention_mask(anchors, T, N)
    assert m.shape == (2, 3 * N, T + 3 * N)
    for b in range(2):
        for q in range(3 * N):
            a = int(anchors[b, q // N])
            for kv in range(T + 3 * N):
                want = kv < a if kv < T else (kv - T) // N == q // N
                assert bool(m[b, q, kv]) == want, (b, q, kv)


@pytest.fixture(scope="module")
def tiny_pair():
    r = dataclasses.replace(get_recipe("v1-smoke"), init_std=0.2, block_size=4)
    target = build_target(r, "cpu", seed=0).eval().requires_grad_(False)
    draft = build_block_draft(r, target, markov_rank=8, seed=1).eval().requires_grad_(False)
    return target, draft


def _paged(model, B, T, page=4):
    pages = -(-T // page)
    cache = model.make_cache(B * pages, page, torch.float32, "cpu")
    return cache, torch.arange(B * pages).view(B, pages)


def test_dense_target_matches_paged_runtime(tiny_pair):
    target, _ = tiny_pair
    tokens = torch.randint(2, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    logits, taps = causal_lm_forward(target, tokens, target.tap_layer_ids)
    cache, table = _paged(target, 2, 13)
    pos = torch.arange(13).expand(2, 13)
    ref_logits, ref_taps = target(tokens, pos, table, cache)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps, ref_taps, atol=1e-4, rtol=1e-4)


def test_dense_draft_blocks_match_runtime_blocks(tiny_pair):
    """Several blocks in one dense pass == one runtime draft_context + draft block per anchor:
    a block sees exactly the context before its anchor and its own rows."""
    target, draft = tiny_pair
    N, T = draft.config.block_size, 16
    tokens = torch.randint(2, 512, (2, T), generator=torch.Generator().manual_seed(1))
    _, taps = causal_lm_forward(target, tokens, target.tap_layer_ids)
    anchors = torch.tensor([[1, 6, 11], [9, 3, 14]])      # unsorted, near both ends
    U = draft_block_logits(draft, taps, tokens, anchors)                    # [2, 3, N, V]
    pos = torch.arange(T).expand(2, T)
    for j in range(anchors.shape[1]):
        cache, table = _paged(draft, 2, T + N)
        a = anchors[:, j]
        draft.context(taps, torch.where(pos < a[:, None], pos, -1), table, cache)
        ref = draft.block(tokens.gather(1, a[:, None])[:, 0], a, table, cache)   # [2, N, V]
        torch.testing.assert_close(U[:, j], ref, atol=1e-4, rtol=1e-4)


def test_dense_forward_of_fused_modules_equals_unfused(tiny_pair):
    """LLM's modules come fused (q/k/v and gate/up as one GEMM each): the dense forwards that
    offline evaluation runs over them compute the same logits and taps."""
    import copy

    from dspark_trt.models.fuse import fuse_projections_
    target, _ = tiny_pair
    fused = copy.deepcopy(target)
    assert fuse_projections_(fused) > 0
    tokens = torch.randint(0, target.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    want, want_taps = causal_lm_forward(target, tokens, tap_layer_ids=(0,))
    got, got_taps = causal_lm_forward(fused, tokens, tap_layer_ids=(0,))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_taps, want_taps, atol=1e-5, rtol=1e-5)
