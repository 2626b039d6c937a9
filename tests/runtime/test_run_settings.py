"""Run settings (N, the Markov sampler mode, the TP world) are arguments held by the runtime's
objects, not attributes of the torch modules (docs/architecture.md, "Where the run settings live")."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.config import ConfigError, get_preset
from dspark_trt.config.source import resolve_num_spec_tokens
from dspark_trt.runtime.llm import LLM

PRESET = "qwen3-tiny-dspark"
RUN_SETTINGS = ("num_spec_tokens", "markov_sampler", "tp_world", "tp_size")


def test_modules_hold_no_run_settings_and_the_networks_pass_them():
    llm = LLM.from_preset(PRESET, device="cpu", num_spec_tokens=3, markov_sampler="topk",
                          max_batch_size=2, max_seq_len=64)
    for m in (llm.target, llm.draft):
        assert [a for a in RUN_SETTINGS if hasattr(m, a)] == []
    assert (llm.networks.num_spec_tokens, llm.networks.markov_sampler, llm.tp_size) == (3, "topk", 1)
    one = torch.tensor([1])
    drafts, z = llm.networks.draft_block(one, torch.tensor([0]), torch.tensor([[0]]),
                                         torch.zeros(1), one)
    assert drafts.shape == (1, 3) and z.shape == (1, 3, llm.pair.target.vocab_size)


def test_n_defaults_to_the_draft_configs_block_size():
    draft = get_preset(PRESET).draft
    assert resolve_num_spec_tokens(None, draft) == draft.block_size
    assert resolve_num_spec_tokens(2, draft) == 2
    with pytest.raises(ConfigError, match="num_spec_tokens must be >= 1, got -1"):
        resolve_num_spec_tokens(-1, draft)
