"""``LLM``'s eager modules as engines prepare them (fused q/k/v and gate/up) and compiled
(``LLM(..., compile=...)``): the same greedy tokens as the unfused modules, logits within bf16
tolerance. On CPU the compiled path traces with ``aot_eager`` (dynamo + functionalisation of the
in-place cache writes, no C++ code generation); tests/runtime/test_runtime_graphs.py-style GPU
runs use inductor (``test_inductor_step_regions_match_eager_on_gpu``)."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.config import ConfigError
from dspark_trt.models.fuse import FusedLinear, qwen3_fused_sizes, unfuse_state_dict, unfused_state_dict
from dspark_trt.runtime import LLM, SamplingParams
from dspark_trt.runtime.compiled import compile_backend, mark_caches_static

PRESET = "qwen3-tiny-dspark"
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11], [8, 1, 64, 300, 12]]
BF16_ATOL = 2 ** -6                  # logits of O(1): a few bf16 ulps


def make(dtype=torch.bfloat16, device="cpu", **kw) -> LLM:
    return LLM.from_preset(PRESET, dtype=dtype, device=device, max_batch_size=2, max_seq_len=48,
                           page_size=8, seed=3, **kw)


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The target's logits [T, V] (fp32) over ``ids`` from a fresh cache."""
    t = llm.target
    cache = t.make_cache(4, 8, llm.dtype, llm.device)
    mark_caches_static(cache)
    tokens = torch.tensor([ids], device=llm.device)
    pos = torch.arange(len(ids), device=llm.device)[None]
    table = torch.arange(4, device=llm.device)[None]
    with torch.inference_mode():
        return t(tokens, pos, table, cache)[0][0].float()


def greedy(llm: LLM, speculative: bool, prompts=PROMPTS) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return [o.output_ids for o in llm.generate(prompts, sp, speculative=speculative)]


@pytest.fixture(scope="module")
def unfused():
    llm = make(fuse=False)
    return llm, greedy(llm, False), [prefill_logits(llm, p) for p in PROMPTS]


def test_llm_modules_are_fused_like_engines_by_default(unfused):
    llm = make()
    attn = llm.target.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedLinear) and attn.q_proj is None
    assert isinstance(llm.draft.layers[0].mlp.gate_up_proj, FusedLinear)
    assert unfused[0].target.model.layers[0].self_attn.qkv_proj is None
    # the same weights under the HF names (what the HF peer and checkpoint writers read)
    ref = unfused[0].target.state_dict()
    got = unfused_state_dict(llm.target)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_fused_eager_path_keeps_greedy_tokens_and_logits(unfused):
    ref_llm, ref_tokens, ref_logits = unfused
    llm = make()
    for p, want in zip(PROMPTS, ref_logits):
        torch.testing.assert_close(prefill_logits(llm, p), want, atol=BF16_ATOL, rtol=2 ** -7)
    assert greedy(llm, False) == ref_tokens
    assert greedy(llm, True) == ref_tokens                 # greedy speculative == greedy AR


@pytest.mark.slow
def test_compiled_eager_path_keeps_greedy_tokens_and_logits(unfused):
    """One prompt (every new shape class is a trace: about 20 s on two CPU cores)."""
    _, ref_tokens, ref_logits = unfused
    llm = make(compile="aot_eager")
    assert llm.compiled == "aot_eager"
    assert hasattr(llm.target.model.layers[0].attention_input, "_torchdynamo_orig_callable")
    torch.testing.assert_close(prefill_logits(llm, PROMPTS[0]), ref_logits[0], atol=BF16_ATOL,
                               rtol=2 ** -7)
    assert greedy(llm, False, PROMPTS[:1]) == ref_tokens[:1]
    assert greedy(llm, True, PROMPTS[:1]) == ref_tokens[:1]


def test_unfuse_state_dict_splits_by_config_and_names_bad_sizes():
    llm = make()
    fused = {f"target.{k}": v for k, v in llm.target.state_dict().items()}
    out = unfuse_state_dict({k.removeprefix("target."): v for k, v in fused.items()},
                            qwen3_fused_sizes(llm.pair.target))
    assert set(out) == set(unfused_state_dict(llm.target))
    w = llm.target.model.layers[0].self_attn.qkv_proj.weight
    with pytest.raises(ValueError, match="qkv_proj.weight: .* rows do not split"):
        unfuse_state_dict({"a.qkv_proj.weight": w}, {"qkv_proj": [1, 1, 1]})


def test_compile_option_is_checked():
    assert compile_backend(False) is None and compile_backend(True) == "inductor"
    with pytest.raises(ConfigError, match="compile='tensorrt'"):
        compile_backend("tensorrt")
    with pytest.raises(ConfigError, match="engine's networks are compiled already"):
        LLM(make().pair, None, None, networks=object(), compile=True)


@pytest.mark.gpu
def test_inductor_step_regions_match_eager_on_gpu():
    """Inductor-compiled layers on CUDA inside the CUDA graphs: bf16 logits within tolerance of the
    unfused eager modules; greedy tokens equal in fp32 (bf16 reductions in another order may flip
    a near-tie of random weights, fp32 ones do not at these sizes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (inductor's Triton code generation)")
    ref, llm = make(device="cuda", fuse=False), make(device="cuda", compile=True)
    for p in PROMPTS:
        want = prefill_logits(ref, p)
        torch.testing.assert_close(prefill_logits(llm, p), want, atol=4 * BF16_ATOL * max(1.0, float(want.abs().max())),
                                   rtol=2 ** -6)
    ref, llm = make(torch.float32, "cuda", fuse=False), make(torch.float32, "cuda", compile=True)
    want = greedy(ref, False)
    assert greedy(llm, False) == want
    assert greedy(llm, True) == want
