"""Qwen3-FP8 checkpoints (issue #23): a tiny target written in the published layout (projection
``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128x128 block, embeddings / norms / lm_head
wide, ``quantization_config`` in config.json) loads with its projections kept in fp8.

Tolerance of native vs the bf16-dequantised reference: on CPU both run the op's reference
(dequantise to the activation dtype, then matmul), so the logits are equal bitwise (tolerance 0);
the GPU kernel's differences are bounded in tests/plugins/test_fp8_linear.py."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from torch import nn

from dspark_trt.checkpoints.files import CheckpointError, write_checkpoint
from dspark_trt.checkpoints.loaders import load_pair
from dspark_trt.checkpoints.prepare import prepare_models
from dspark_trt.checkpoints.qwen3 import qwen3_draft_tensors, qwen3_target_tensors
from dspark_trt.config import ConfigError, get_preset
from dspark_trt.config.source import ModelSource
from dspark_trt.models import build_models
from dspark_trt.models.fp8_linear import FP8_PROJECTIONS, Fp8Linear
from dspark_trt.plugins.fp8_linear import quantize_fp8
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

from tests.support.draft_oracles import NearTargetNetworks
from tests.support.models import tiny_pair

# hidden 160 and MLP 320: projections of 2 x 2 and 3 x 2 scale blocks, the last ones partial
PAIR = dict(vocab=64, hidden=160, layers=3, heads=4, kv_heads=2, block=4, rank=8, taps=(0, 1))


def write_fp8_pair(root, seed: int = 0, scale_dtype=torch.float32, sharpen: float = 4.0):
    """Target (fp8 projections) + bf16-style draft checkpoints -> (target dir, draft dir)."""
    pair = tiny_pair(**PAIR)
    target, draft = build_models(pair, torch.float32, "cpu", seed=seed)
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)                # sharper logits: long greedy runs
    tensors = qwen3_target_tensors(target)
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in FP8_PROJECTIONS:
            q, s = quantize_fp8(tensors[name])
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, s.to(scale_dtype)
    cfg = dataclasses.replace(pair.target, quantization="fp8").to_hf()
    write_checkpoint(root / "target", cfg, tensors)
    write_checkpoint(root / "draft", pair.draft.to_hf(), qwen3_draft_tensors(draft))
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    return write_fp8_pair(tmp_path_factory.mktemp("fp8"))


def test_checkpoint_has_the_published_layout(fp8_dirs):
    from safetensors import safe_open
    tdir, _ = fp8_dirs
    cfg = json.loads((tdir / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    with safe_open(str(tdir / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.gate_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (320, 160)
        assert s.dtype == torch.float32 and tuple(s.shape) == (3, 2)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert "lm_head.weight_scale_inv" not in f.keys()


def test_loads_natively_in_fp8(fp8_dirs):
    pair, target, _ = load_pair(*fp8_dirs, torch.float64)
    fp8 = [n for n, m in target.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 7 * PAIR["layers"] and pair.target.quantization == "fp8"
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
               for m in target.modules() if isinstance(m, Fp8Linear))
    assert type(target.lm_head) is nn.Linear and target.lm_head.weight.dtype == torch.float64
    assert target.model.embed_tokens.weight.dtype == torch.float64
    target.to(torch.float32)                                   # dtype casts leave the fp8 weights alone
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in target.modules() if isinstance(m, Fp8Linear))
    from dspark_trt.models.fuse import fuse_projections_
    assert fuse_projections_(target) == 0                      # rows off the 128 grid: scale blocks do not stack
    sd = qwen3_target_tensors(target)                          # and save back in the published layout
    assert sd["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(sd["model.layers.1.self_attn.o_proj.weight_scale_inv"].shape) == (2, 2)


def _llm(target_dir, draft_dir, quantization=None, dtype=torch.float64, batch=3):
    src = ModelSource(checkpoint=str(target_dir), draft_checkpoint=str(draft_dir), quantization=quantization)
    pair, target, draft = prepare_models(src, dtype, "cpu")
    return LLM(pair, target, draft, max_batch_size=batch, max_seq_len=96, page_size=8)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_native_logits_equal_the_dequantised_reference(tmp_path, scale_dtype):
    """Tolerance 0 on CPU (module doc): fp8-native and --quantization none give the same logits."""
    dirs = write_fp8_pair(tmp_path, seed=1, scale_dtype=scale_dtype)
    _, native, _ = load_pair(*dirs, torch.float64)
    pair, deq, _ = load_pair(*dirs, torch.float64, quantization="none")
    assert not any(isinstance(m, Fp8Linear) for m in deq.modules()) and pair.target.quantization is None
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    pos = torch.arange(8)[None]
    outs = []
    for t in (native, deq):
        outs.append(_forward(t, t.make_cache(2, 8, torch.float64, "cpu"), tokens, pos, torch.tensor([[0]])))
    assert torch.equal(outs[0], outs[1])
    # and the fp8 weights are really quantised: the unquantised model differs
    ref_target, _ = build_models(tiny_pair(**PAIR), torch.float64, "cpu", seed=1)
    with torch.no_grad():
        ref_target.lm_head.weight.mul_(4.0)
    full = _forward(ref_target, ref_target.make_cache(2, 8, torch.float64, "cpu"), tokens, pos, torch.tensor([[0]]))
    assert not torch.equal(full, outs[0])
    assert float((full - outs[0]).abs().max()) < 0.1 * float(full.abs().max())


def _forward(target, cache, tokens, pos, table):
    logits, _ = target(tokens, pos, table, cache)
    return logits


def test_speculative_greedy_equals_autoregressive_of_the_fp8_target(fp8_dirs):
    """Lossless against the same-precision target: token for token, with the checkpoint's draft
    and with a near-target oracle draft (long accepted runs through the fp8 verifier)."""
    llm = _llm(*fp8_dirs)
    assert any(isinstance(m, Fp8Linear) for m in llm.target.modules())
    rng = random.Random(0)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(1, 10))] for _ in range(4)]
    sp = SamplingParams(max_new_tokens=24)
    ar = llm.generate(prompts, sp, speculative=False)
    spec = llm.generate(prompts, sp, speculative=True)
    near = Scheduler(NearTargetNetworks(llm.networks, sigma=0.5, seed=1), 3, llm.max_seq_len,
                     llm.pair.target.vocab_size).run([(p, sp) for p in prompts])
    for a, s, n in zip(ar, spec, near):
        assert s.output_ids == a.output_ids == n.output_ids
        assert len(a.output_ids) == 24
    assert max(x for n in near for x in n.stats.accepted) >= 3, "the oracle draft should get runs accepted"


def test_quantization_fp8_quantises_a_wide_checkpoint_and_random_weights(tmp_path):
    pair = tiny_pair(**PAIR)
    target, draft = build_models(pair, torch.float32, "cpu", seed=2)
    write_checkpoint(tmp_path / "t", pair.target.to_hf(), qwen3_target_tensors(target))
    write_checkpoint(tmp_path / "d", pair.draft.to_hf(), qwen3_draft_tensors(draft))
    p, t, d = load_pair(tmp_path / "t", tmp_path / "d", torch.float32)
    assert not any(isinstance(m, Fp8Linear) for m in t.modules()) and p.target.quantization is None
    p, t, d = load_pair(tmp_path / "t", tmp_path / "d", torch.float32, quantization="fp8")
    assert sum(isinstance(m, Fp8Linear) for m in t.modules()) == 7 * PAIR["layers"]
    assert not any(isinstance(m, Fp8Linear) for m in d.modules())       # the draft stays wide
    # the fp8 preset: random weights, projections quantised, draft in the model dtype
    fp8_preset = get_preset("qwen3-8b-fp8-dspark-block7")
    assert fp8_preset.target.quantization == "fp8" and fp8_preset.draft.backbone.quantization is None
    tiny = dataclasses.replace(tiny_pair(**PAIR))
    tiny.target.quantization = "fp8"
    p, t, d = prepare_models(ModelSource(model="x"), torch.float32, "cpu", pair=tiny)
    assert sum(isinstance(m, Fp8Linear) for m in t.modules()) == 7 * PAIR["layers"]
    assert not any(isinstance(m, Fp8Linear) for m in d.modules())
    tiny.target.quantization = "fp8"
    p, t, d = prepare_models(ModelSource(model="x", quantization="none"), torch.float32, "cpu", pair=tiny)
    assert not any(isinstance(m, Fp8Linear) for m in t.modules())


def test_bad_fp8_checkpoints_and_options_are_refused(tmp_path, fp8_dirs):
    from safetensors.torch import load_file
    tdir, ddir = fp8_dirs
    tensors = load_file(str(tdir / "model.safetensors"))
    cfg = json.loads((tdir / "config.json").read_text())
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].float()
    write_checkpoint(tmp_path / "wide", cfg, bad)
    with pytest.raises(CheckpointError, match="up_proj.weight.*float8_e4m3fn"):
        load_pair(tmp_path / "wide", ddir, torch.float32)
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight_scale_inv"] = bad["model.layers.0.mlp.up_proj.weight_scale_inv"][:1]
    write_checkpoint(tmp_path / "scale", cfg, bad)
    with pytest.raises(CheckpointError, match="up_proj.weight_scale_inv.*shape"):
        load_pair(tmp_path / "scale", ddir, torch.float32)
    for field, value, match in (("weight_block_size", [64, 64], "weight_block_size"),
                                ("quant_method", "gptq", "quant_method")):
        c = json.loads(json.dumps(cfg))
        c["quantization_config"][field] = value
        write_checkpoint(tmp_path / field, c, tensors)
        with pytest.raises(ConfigError, match=match):
            load_pair(tmp_path / field, ddir, torch.float32)
    # DeepSeek-V4 random weights: its V4_FP8_MODULES linears quantised; other archs refused
    _, v4, _ = prepare_models(ModelSource(model="deepseek-v4-tiny-dspark", quantization="fp8"), torch.float32, "cpu")
    assert any(isinstance(m, Fp8Linear) for m in v4.modules())
    from dspark_trt.checkpoints.fp8 import check_quantization
    with pytest.raises(ConfigError, match="Qwen3 and DeepSeek-V4 targets only"):
        check_quantization("fp8", "llama")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_checkpoint_on_gpu_runs_the_kernel(fp8_dirs):
    """On CUDA the projections run the Triton kernel. bf16: logits within 3 % of the largest logit
    of the bf16-dequantised reference (the kernel keeps the exact fp8 x scale product, the
    reference rounds W to bf16; 3 layers of bf16 activations). fp32 activations: speculative
    greedy == autoregressive greedy token for token (lossless against the same fp8 target)."""
    from dspark_trt.plugins.kernels import fp8_gemm
    calls = []
    orig = fp8_gemm.fp8_gemm
    fp8_gemm.fp8_gemm = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        _, native, _ = load_pair(*fp8_dirs, torch.bfloat16, "cuda")
        _, deq, _ = load_pair(*fp8_dirs, torch.bfloat16, "cuda", quantization="none")
        tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device="cuda")
        pos, table = torch.arange(8, device="cuda")[None], torch.tensor([[0]], device="cuda")
        a = _forward(native, native.make_cache(2, 8, torch.bfloat16, "cuda"), tokens, pos, table).float()
        b = _forward(deq, deq.make_cache(2, 8, torch.bfloat16, "cuda"), tokens, pos, table).float()
        assert calls, "the fp8 kernel did not run"
        assert float((a - b).abs().max()) <= 0.03 * float(b.abs().max())
        src = ModelSource(checkpoint=str(fp8_dirs[0]), draft_checkpoint=str(fp8_dirs[1]))
        pair, target, draft = prepare_models(src, torch.float32, "cuda")
        llm = LLM(pair, target, draft, max_batch_size=3, max_seq_len=96, page_size=8, device="cuda",
                  dtype=torch.float32)
        rng = random.Random(0)
        prompts = [[rng.randrange(63) for _ in range(rng.randint(1, 10))] for _ in range(3)]
        sp = SamplingParams(max_new_tokens=24)
        ar = llm.generate(prompts, sp, speculative=False)
        spec = llm.generate(prompts, sp, speculative=True)
        assert [s.output_ids for s in spec] == [x.output_ids for x in ar]
    finally:
        fp8_gemm.fp8_gemm = orig


def test_w8a8_quantises_the_projections_inputs_and_stays_lossless(fp8_dirs):
    """``--quantization fp8-w8a8``: the checkpoint loads as with "fp8", then every fp8 projection
    quantises its input per (token, 128 columns) too. Its logits equal a model whose projections
    are the W8A8 reference (``fp8_linear_ref(act_quant=True)``) exactly on CPU and differ from the
    weight-only ones; speculative greedy output equals the W8A8 target's own, token for token."""
    from dspark_trt.plugins.fp8_linear import fp8_linear_ref
    llm = _llm(*fp8_dirs, quantization="fp8-w8a8")
    fp8 = [m for m in llm.target.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 7 * PAIR["layers"] and all(m.act_quant for m in fp8)
    _, wo, _ = load_pair(*fp8_dirs, torch.float64)
    tokens, pos = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), torch.arange(8)[None]
    w8a8 = _forward(llm.target, llm.target.make_cache(2, 8, torch.float64, "cpu"), tokens, pos, torch.tensor([[0]]))
    for m in wo.modules():                                     # the same model, projections as the reference
        if isinstance(m, Fp8Linear):
            m.forward = lambda x, m=m: fp8_linear_ref(x, m.weight, m.weight_scale_inv, act_quant=True)
    ref = _forward(wo, wo.make_cache(2, 8, torch.float64, "cpu"), tokens, pos, torch.tensor([[0]]))
    assert torch.equal(w8a8, ref)
    _, wo, _ = load_pair(*fp8_dirs, torch.float64)
    weight_only = _forward(wo, wo.make_cache(2, 8, torch.float64, "cpu"), tokens, pos, torch.tensor([[0]]))
    assert not torch.equal(w8a8, weight_only)
    rng = random.Random(1)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    sp = SamplingParams(max_new_tokens=16)
    for a, s in zip(llm.generate(prompts, sp, speculative=False), llm.generate(prompts, sp, speculative=True)):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 16
    with pytest.raises(ConfigError, match="no fp8 projections"):       # nothing in fp8 to run W8A8
        from dspark_trt.checkpoints.fp8 import fp8_activations_
        fp8_activations_(llm.draft)
