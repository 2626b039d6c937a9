"""L2 prefetch of the o projection's weights (issue #21): a hint that launches only where it can
(enabled, CUDA sm_90+, outside traces) and never changes a result."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.plugins import l2_prefetch as lp


def test_off_by_default_and_never_on_cpu(monkeypatch):
    monkeypatch.delenv(lp.ENV, raising=False)
    w = torch.randn(64, 64)
    assert not lp.prefetch_weight(w)
    monkeypatch.setenv(lp.ENV, "1")
    assert not lp.prefetch_weight(w)                        # a CPU tensor
    assert not lp.prefetch_weight(None)


def test_generation_unchanged_when_enabled_on_cpu(monkeypatch):
    """The attention island calls it; on a CPU it does nothing, so tokens are the same."""
    from dspark_trt.models import build_models
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.sampling_params import SamplingParams
    from tests.support.models import tiny_pair
    outs = []
    for env in ("0", "1"):
        monkeypatch.setenv(lp.ENV, env)
        pair = tiny_pair()
        target, draft = build_models(pair, torch.float64, "cpu", seed=3)
        llm = LLM(pair, target, draft, max_batch_size=2, max_seq_len=64, page_size=8)
        outs.append(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10))[0].output_ids)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability >= 9 (bulk L2 prefetch)")
def test_prefetch_launches_in_a_graph_and_changes_nothing(monkeypatch):
    monkeypatch.setenv(lp.ENV, "1")
    w = torch.randn(4096, 4104, device="cuda").bfloat16()      # a size that is no multiple of a chunk
    x = torch.randn(1, 4104, device="cuda").bfloat16()
    ref = torch.nn.functional.linear(x, w)
    assert lp.prefetch_weight(w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lp.prefetch_weight(w)
        y = torch.nn.functional.linear(x, w)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    assert not lp.prefetch_weight(w[:, :7])                 # not contiguous: skipped
