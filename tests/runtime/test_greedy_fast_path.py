"""The CPU references' all-greedy shortcut (plugins/dispatch.py:all_greedy_eager_cpu) returns
exactly what the full sampling arithmetic returns for greedy rows, and is really taken."""
import importlib

import pytest
import torch

from dspark_trt.plugins import dispatch

ms = importlib.import_module("dspark_trt.plugins.markov_sample")     # the modules, not the ops
rs = importlib.import_module("dspark_trt.plugins.rejection_sample")


def _markov_inputs(B=3, N=5, V=97, r=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, N, V, generator=g), torch.tensor([4, -1, 60]), torch.randn(V, r, generator=g),
            torch.randn(V, r, generator=g), torch.zeros(B), torch.tensor([1, 2, 3]), torch.tensor([10, -1, 7]))


def _no_noise(*a, **k):
    raise AssertionError("the greedy shortcut drew sampling noise")


@pytest.mark.parametrize("seed", range(4))
def test_markov_greedy_shortcut_equals_full_path(monkeypatch, seed):
    args = _markov_inputs(seed=seed)
    monkeypatch.setattr(ms, "gumbel", _no_noise)                       # shortcut: no noise at all
    fast_tokens, fast_z = ms.markov_sample_ref(*args)
    monkeypatch.undo()
    monkeypatch.setattr(ms, "all_greedy_eager_cpu", lambda t: False)   # the full arithmetic
    tokens, z = ms.markov_sample_ref(*args)
    assert torch.equal(fast_tokens, tokens) and torch.equal(fast_z, z)
    assert (tokens[1] == -1).all() and (tokens[[0, 2]] >= 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_rejection_greedy_shortcut_equals_full_path(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 4, 5, 31
    target = torch.randn(B, N + 1, V, generator=g)
    drafts = target[:, :N].argmax(-1)
    drafts[0, 2] = (drafts[0, 2] + 1) % V                                # row 0 rejects at 2
    drafts[1, 0] = (drafts[1, 0] + 1) % V                                # row 1 rejects at 0
    args = (target, drafts, torch.randn(B, N, V, generator=g), torch.zeros(B),
            torch.arange(B), torch.tensor([5, 9, -1, 3]))
    monkeypatch.setattr(rs, "gumbel", _no_noise)
    monkeypatch.setattr(rs, "uniform", _no_noise)
    fast = rs.rejection_sample_ref(*args)
    monkeypatch.undo()
    monkeypatch.setattr(rs, "all_greedy_eager_cpu", lambda t: False)
    full = rs.rejection_sample_ref(*args)
    assert all(torch.equal(a, b) for a, b in zip(fast, full))
    assert full[0].tolist() == [2, 0, 0, N] and full[1][2] == -1


def test_shortcut_only_when_every_row_is_greedy():
    assert dispatch.all_greedy_eager_cpu(torch.zeros(3))
    assert not dispatch.all_greedy_eager_cpu(torch.tensor([0.0, 0.7, 0.0]))


def test_no_shortcut_while_tracing():
    """Under export / make_fx the branch would be baked into the graph: never taken there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    with FakeTensorMode() as mode:
        assert not dispatch.all_greedy_eager_cpu(mode.from_tensor(torch.zeros(2)))
    seen = []
    make_fx(lambda t: seen.append(dispatch.all_greedy_eager_cpu(t)) or t + 1)(torch.zeros(2))
    assert seen == [False]
