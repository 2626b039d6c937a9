"""The shipped default pair (dspark_trt/assets/default) is lossless: greedy speculative output
equals greedy target-only output, token for token (fp32 on CPU)."""
import pytest

from dspark_trt import LLM, SamplingParams
from dspark_trt.commands.common import DEFAULT_ASSETS, default_pair_dirs

pytestmark = pytest.mark.skipif(default_pair_dirs() is None,
                                reason=f"no trained default pair under {DEFAULT_ASSETS} yet "
                                       "(added after the GPU training run)")

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n"]


@pytest.fixture(scope="module")
def llm():
    target, draft = default_pair_dirs()
    return LLM.from_checkpoints(target, draft, device="cpu", max_batch_size=len(PROMPTS),
                                max_seq_len=128)


def test_default_pair_greedy_speculative_equals_target(llm):
    sp = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    ref = llm.generate(PROMPTS, sp, speculative=False)
    spec = llm.generate(PROMPTS, sp)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ref]
    assert llm.tokenizer is not None and all(o.text for o in spec)


def _tau(llm) -> float:
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True))
    rounds = sum(o.stats.rounds for o in out)
    return sum(sum(o.stats.accepted) + o.stats.rounds for o in out) / rounds


def test_default_pair_is_trained():
    """The trained draft accepts clearly more than the same draft re-initialised at random on the
    same target. Measured at 7508d0e on these prompts (block 7, greedy, 48 tokens): trained tau
    2.55, control 1.00; the held-out table (benchmarks/results/acceptance-h200-f85e5cd.md) has
    2.68 +- 0.29. Asked: tau >= 2.0 and >= control + 1.0."""
    import torch
    target, draft = default_pair_dirs()
    llm = LLM.from_checkpoints(target, draft, device="cpu", max_batch_size=len(PROMPTS), max_seq_len=128)
    trained = _tau(llm)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in llm.draft.named_parameters():
            if name.split(".")[0] not in ("embed_tokens", "lm_head") and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    control = _tau(llm)
    assert trained >= 2.0 and trained >= control + 1.0, (trained, control)
