"""A few training steps of each model (target, DSpark, DFlash, AR draft) lower its loss."""
import dataclasses

import pytest
import torch

from dspark_trt.train.objective import LossWeights
from dspark_trt.train.pipeline import Run, train_ar_draft, train_block_draft, train_target
from dspark_trt.train.recipe import Schedule, get_recipe

STEPS = 24


def _stream(n_segments=400, vocab=64, seed=0) -> torch.Tensor:
    """Learnable synthetic text: segments counting up mod 62 with a per-segment stride 1..3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_segments):
        start = torch.randint(0, 62, (1,), generator=g).item()
        stride = 1 + torch.randint(0, 3, (1,), generator=g).item()
        out += [2 + (start + stride * i) % 62 for i in range(24)] + [0]
    return torch.tensor(out, dtype=torch.int32)


@pytest.fixture(scope="module")
def run():
    sched = Schedule(budget_share=0.25, batch_size=8, seq_len=32, lr=1e-2, warmup=3, steps=STEPS,
                     num_anchors=8, eval_points=1)
    r = dataclasses.replace(get_recipe("v1-smoke"), vocab_size=64, hidden_size=32, num_layers=3,
                            num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                            tap_layer_ids=[0, 1], block_size=4, markov_rank=8, target=sched,
                            dspark=sched, dflash=sched, ar=sched).validate()
    torch.manual_seed(0)
    run = Run(r, "cpu", autocast=False, log=lambda m: None)
    run.train_stream, run.heldout_stream = _stream(seed=0), _stream(n_segments=40, seed=1)
    return run


@pytest.fixture(scope="module")
def target(run):
    target, hist = train_target(run, budget_s=60)
    return target, hist


def _decreased(hist, factor):
    first, last = sum(hist.train_loss[:3]) / 3, sum(hist.train_loss[-3:]) / 3
    assert len(hist.train_loss) == STEPS
    assert last < factor * first, f"{hist.name}: loss {first:.3f} -> {last:.3f}"


def test_target_loss_decreases(target):
    _decreased(target[1], 0.8)
    assert target[1].eval[-1]["ce"] < 0.8 * torch.log(torch.tensor(64.0)).item()


@pytest.mark.parametrize("name,rank,weights,factor", [("dspark", 8, LossWeights(), 0.85),
                                                      ("dflash", 0, LossWeights(ce=1.0, l1=0.0), 0.9)])
def test_block_draft_loss_decreases(run, target, name, rank, weights, factor):
    draft, hist = train_block_draft(run, target[0], name, rank, weights, run.r.dspark, 60, seed=5)
    _decreased(hist, factor)
    assert (draft.markov_head is not None) == (rank > 0)
    assert not any(p.requires_grad for p in target[0].parameters())


def test_ar_draft_loss_decreases(run, target):
    ar, hist = train_ar_draft(run, target[0], LossWeights(), 60, seed=7)
    _decreased(hist, 0.85)
    assert len(ar.model.layers) == 1 and ar.model.embed_tokens is target[0].model.embed_tokens
