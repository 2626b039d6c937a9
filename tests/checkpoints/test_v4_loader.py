"""V4 checkpoint naming, quantised formats and loading (tiny checkpoints written here)."""
import pytest
import torch

from dspark_trt.checkpoints.files import CheckpointError, read_tensors, write_checkpoint
from dspark_trt.checkpoints.loaders import load_pair
from dspark_trt.checkpoints.quant import (E2M1, dequant_fp8_block, dequant_mxfp4, e8m0_to_float,
                                      quant_fp8_block, quant_mxfp4)
from dspark_trt.checkpoints.v4 import remap_name, v4_checkpoint_tensors
from dspark_trt.config import get_preset
from dspark_trt.models import build_models


@pytest.mark.parametrize("name,want", [
    ("mtp.1.attn.wq_a.weight", ("draft", "layers.1.attn.wq_a.weight")),
    ("mtp.0.main_proj.scale", ("draft", "main_proj.weight_scale_inv")),
    ("mtp.2.markov_head.markov_w1.weight", ("draft", "markov_head.markov_w1.weight")),
    ("mtp.2.hc_head_fn", ("draft", "hc_head.fn")),
    ("mtp.2.norm.weight", ("draft", "norm.weight")),
    ("mtp.0.attn_norm.weight", ("draft", "layers.0.attn_norm.weight")),
    ("mtp.1.hc_ffn_scale", ("draft", "layers.1.hc_ffn.scale")),
    ("mtp.0.confidence_head.proj.weight", ("draft", "confidence_head.proj.weight")),
    ("mtp.2.confidence_head.proj.weight", ("draft", "confidence_head.proj.weight")),
    ("mtp.1.ffn.experts.3.w2.scale", ("draft", "layers.1.ffn.experts.3.w2.weight_scale")),
    ("layers.4.ffn.experts.0.w1.scale", ("target", "layers.4.ffn.experts.0.w1.weight_scale")),
    ("layers.4.ffn.shared_experts.w1.scale", ("target", "layers.4.ffn.shared_experts.w1.weight_scale_inv")),
    ("layers.2.attn.indexer.wq_b.scale", ("target", "layers.2.attn.indexer.wq_b.weight_scale_inv")),
    ("hc_head_base", ("target", "hc_head.base")),
])
def test_remap_names(name, want):
    assert remap_name(name, "fp4") == want


def test_expert_scale_is_block_fp8_when_experts_are_not_fp4():
    assert remap_name("layers.0.ffn.experts.1.w3.scale", "fp8")[1].endswith(".weight_scale_inv")


def test_e8m0_and_mxfp4_decoding():
    raw = torch.tensor([127, 128, 120, 255], dtype=torch.uint8)
    v = e8m0_to_float(raw)
    assert v[:3].tolist() == [1.0, 2.0, 2.0 ** -7] and v[3].isnan()
    # one row, 32 logical values: codes 0..15 twice; byte = low (even) | high (odd) << 4
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(torch.int8)[None]
    out = dequant_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))     # scale 2
    want = torch.where(codes >= 8, -E2M1[codes % 8], E2M1[codes % 8]) * 2
    assert torch.equal(out[0], want)


def test_quantisers_round_trip_within_format_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 3)
    scale = e8m0_to_float(s).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4; subnormal step 2^-9 of the block scale
    err = (dequant_fp8_block(q, s) - w).abs()
    assert (err <= w.abs() * 2 ** -4 + scale * 2 ** -10).all()
    w = torch.randn(64, 96, generator=g)
    q, s = quant_mxfp4(w)
    assert q.dtype == torch.int8 and tuple(q.shape) == (64, 48) and tuple(s.shape) == (64, 3)
    d = dequant_mxfp4(q, s)
    grid = e8m0_to_float(s).repeat_interleave(32, 1)
    # largest E2M1 gap is 2 (between 4 and 6): nearest rounding errs by at most 1 grid unit
    assert ((d - w).abs() <= grid).all()
    assert torch.equal(dequant_mxfp4(*quant_mxfp4(d)), d)               # representable -> exact


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    pair = get_preset("deepseek-v4-tiny-dspark")
    target, draft = build_models(pair, seed=0)
    tensors = v4_checkpoint_tensors(target, draft, quantize=True)
    tensors["mtp.0.confidence_head.proj.weight"] = torch.zeros(1, 80)
    d = tmp_path_factory.mktemp("v4ckpt")
    write_checkpoint(d, pair.draft.to_hf(), tensors, max_shard_bytes=300_000)
    return d, target, draft, tensors


def test_quantised_checkpoint_loads_within_format_error(tiny_checkpoint):
    d, target, draft, tensors = tiny_checkpoint
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert "mtp.2.markov_head.markov_w1.weight" in tensors
    pair, t2, d2 = load_pair(d, d)
    assert pair.draft.num_stages == 3
    for orig, loaded in ((target, t2), (draft, d2)):
        got = loaded.state_dict()
        for name, w in orig.state_dict().items():
            v = got[name]
            if ".experts." in name and "shared" not in name and name.endswith("weight"):
                grid = w.abs().view(w.shape[0], -1, 32).amax(-1, keepdim=True) / 3     # > e8m0 scale
                assert ((v - w).abs().view(w.shape[0], -1, 32) <= grid).all(), name
            elif (name.endswith(("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                                  "main_proj.weight")) and "compressor" not in name) or "shared_experts" in name:
                assert ((v - w).abs() <= w.abs() * 2 ** -4 + w.abs().max() * 2 ** -9).all(), name
            else:
                assert torch.equal(v, w), name                                # stored unquantised


def test_loaded_pair_generates(tiny_checkpoint):
    from dspark_trt.runtime import LLM, SamplingParams
    d = tiny_checkpoint[0]
    llm = LLM.from_checkpoints(d, d, device="cpu", max_batch_size=1, max_seq_len=64, page_size=16)
    out = llm.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=6))[0]
    assert len(out.output_ids) == 6 and out.stats.rounds > 0


def _rewrite(src, dst, edit):
    from dspark_trt.config import read_json
    tensors = read_tensors(src)
    edit(tensors)
    write_checkpoint(dst, read_json(src / "config.json"), tensors)


def test_bad_checkpoints_name_tensor_and_file(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint[0]
    cases = [
        (lambda t: t.pop("layers.2.attn.wo_b.weight"), "missing.*wo_b|scale tensor 'layers.2.attn.wo_b.scale"),
        (lambda t: t.update({"layers.0.attn.wkv.weight": t["layers.0.attn.wkv.weight"][:8]}),
         "layers.0.attn.wkv"),
        (lambda t: t.update({"layers.1.ffn.experts.2.w1.scale": t["layers.1.ffn.experts.2.w1.scale"][:, :1]}),
         "layers.1.ffn.experts.2.w1.weight' in .*MXFP4 scale"),
        (lambda t: t.pop("mtp.1.attn.attn_sink"), "layers.1.attn.attn_sink"),
        (lambda t: t.update({"mtp.1.attn.bogus": torch.zeros(2)}), "unexpected tensor 'mtp.1.attn.bogus' in .*safetensors"),
    ]
    for i, (edit, pattern) in enumerate(cases):
        dst = tmp_path / f"bad{i}"
        _rewrite(src, dst, edit)
        with pytest.raises(CheckpointError, match=pattern):
            load_pair(dst, dst)


def test_fp8_quantization_keeps_the_stored_fp8_linears_native(tiny_checkpoint):
    """``quantization="fp8"``: the V4 linears of ``V4_FP8_MODULES`` load as ``Fp8Linear`` holding
    the checkpoint's fp8 bytes and its E8M0 scales as fp32; the target's logits equal the
    dequantising load's exactly (fp32: the same products); wo_a and the draft stay dequantised
    (the routed experts stay MXFP4: next test)."""
    from dspark_trt.checkpoints.fp8 import V4_FP8_MODULES
    from dspark_trt.models.fp8_linear import Fp8Linear
    d, _, _, tensors = tiny_checkpoint
    _, ref, _ = load_pair(d, d)
    _, t8, d8 = load_pair(d, d, quantization="fp8")
    fp8 = {n: m for n, m in t8.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 and all(V4_FP8_MODULES.search(n) for n in fp8)
    assert not any(isinstance(m, Fp8Linear) for m in d8.modules())
    assert not any(n.endswith("wo_a") or ".experts." in n for n in fp8)
    for n, m in fp8.items():
        stored = tensors[f"{n}.weight"]
        assert torch.equal(m.weight.view(torch.uint8), stored.view(torch.uint8)), n
        assert torch.equal(m.weight_scale_inv, e8m0_to_float(tensors[f"{n}.scale"])), n
    from dspark_trt.runtime import LLM, SamplingParams
    kw = dict(device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=64, page_size=16)
    llms = [LLM.from_checkpoints(d, d, quantization=q, **kw) for q in (None, "fp8")]
    assert sum(isinstance(m, Fp8Linear) for m in llms[1].networks.target_module.modules()) == len(fp8)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    positions, table = torch.arange(5)[None], torch.arange(4)[None]
    with torch.no_grad():
        (a, _), (b, _) = (llm.networks.target(tokens, positions, table) for llm in llms)
    assert torch.equal(a, b)
    outs = [llm.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=8))[0].output_ids for llm in llms]
    assert outs[0] == outs[1]


MX_PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 3, 50, 60, 2]]


def _native_vs_dequantised(d, device: str, dtype: torch.dtype):
    """LLMs of checkpoint ``d`` with ``quantization="fp8"`` and with the default (dequantised), and
    their target logits on one 5-token prompt -> (native, dequantised, logits, logits)."""
    from dspark_trt.runtime import LLM
    kw = dict(device=device, dtype=dtype, max_batch_size=3, max_seq_len=64, page_size=16)
    llms = [LLM.from_checkpoints(d, d, quantization=q, **kw) for q in ("fp8", None)]
    tokens = torch.tensor([[1, 2, 3, 4, 5]], device=device)
    positions, table = torch.arange(5, device=device)[None], torch.arange(4, device=device)[None]
    with torch.no_grad():
        logits = [llm.networks.target(tokens, positions, table)[0] for llm in llms]
    return (*llms, *logits)


def _greedy(llm, speculative: bool, n: int = 16) -> list[list[int]]:
    from dspark_trt.runtime import SamplingParams
    outs = llm.generate(MX_PROMPTS, SamplingParams(max_new_tokens=n), speculative=speculative)
    assert all(len(o.output_ids) == n for o in outs)
    return [o.output_ids for o in outs]


def test_fp8_quantization_keeps_the_routed_experts_in_mxfp4(tiny_checkpoint):
    """``quantization="fp8"`` with fp4 experts: the target's routed experts load as ``Mxfp4Linear``
    holding the checkpoint's packed bytes and E8M0 scales unchanged (the draft's are dequantised)
    and ``LLM.from_checkpoints`` stacks them into ``dspark::moe_experts_mxfp4``'s buffers.
    Tolerance of the logits against the dequantising load: 0, in fp32 and in bf16 (on CPU both run
    the references: the same dequantised values, exact in either dtype, through the same matmuls).
    Greedy tokens equal; speculative greedy equals autoregressive greedy of the MXFP4 target, with
    the checkpoint's draft and with a near-target oracle draft (long accepted runs)."""
    from dspark_trt.models.mxfp4_linear import Mxfp4Linear
    from dspark_trt.runtime import SamplingParams
    from dspark_trt.runtime.scheduler import Scheduler
    from tests.support.draft_oracles import NearTargetNetworks
    d, _, _, tensors = tiny_checkpoint
    _, t8, d8 = load_pair(d, d, quantization="fp8")
    mx = {n: m for n, m in t8.named_modules() if isinstance(m, Mxfp4Linear)}
    assert len(mx) == 3 * 8 * 5 and not any(isinstance(m, Mxfp4Linear) for m in d8.modules())
    for n, m in mx.items():
        assert torch.equal(m.weight, tensors[f"{n}.weight"].view(torch.uint8)), n
        assert torch.equal(m.weight_scale, tensors[f"{n}.scale"].view(torch.uint8)), n
    for dtype in (torch.bfloat16, torch.float32):
        native, deq, a, b = _native_vs_dequantised(d, "cpu", dtype)
        moe = native.target.layers[1].ffn
        assert moe.w13 is None and moe.w13_packed.dtype == moe.w13_scale.dtype == torch.uint8
        assert [tuple(t.shape) for t in (moe.w13_packed, moe.w13_scale, moe.w2_packed, moe.w2_scale)] == \
            [(8, 64, 32), (8, 64, 2), (8, 64, 16), (8, 64, 1)]
        assert deq.target.layers[1].ffn.w13.dtype == dtype
        assert torch.equal(a, b), dtype
    ar = _greedy(native, False)                                            # fp32 from here on
    assert ar == _greedy(deq, False) == _greedy(native, True)
    sp = SamplingParams(max_new_tokens=16)
    near = Scheduler(NearTargetNetworks(native.networks, sigma=0.1, seed=1), 3, native.max_seq_len,
                     native.pair.target.vocab_size).run([(p, sp) for p in MX_PROMPTS])
    assert [n.output_ids for n in near] == ar
    assert max(x for n in near for x in n.stats.accepted) >= 3, "the oracle draft should get runs accepted"


def test_native_mxfp4_names_a_bad_expert_tensor(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint[0]
    name = "layers.1.ffn.experts.2.w1"

    def nan_scale(t):
        t[f"{name}.scale"] = t[f"{name}.scale"].clone().view(torch.uint8).fill_(255).view(t[f"{name}.scale"].dtype)

    cases = [(lambda t: t.update({f"{name}.scale": t[f"{name}.scale"][:, :1]}), "MXFP4 scale has shape"),
             (nan_scale, "without 255"),
             (lambda t: t.pop(f"{name}.scale"), "MXFP4 weight torch.int8 .* has no scale")]
    for i, (edit, pattern) in enumerate(cases):
        dst = tmp_path / f"bad{i}"
        _rewrite(src, dst, edit)
        with pytest.raises(CheckpointError, match=f"{name}.weight' in .*{pattern}"):
            load_pair(dst, dst, quantization="fp8")


def test_fp8_quantization_of_a_wide_checkpoint(tmp_path):
    """A V4 checkpoint stored wide (no scales) with ``quantization="fp8"``: the V4_FP8_MODULES
    linears are quantised at load (E8M0 block scales, as the release's), the routed experts to
    MXFP4 (``quant_mxfp4``); each dequantises to within its format's error of the stored weight."""
    from dspark_trt.checkpoints.quant import quant_mxfp4_u8
    from dspark_trt.models.fp8_linear import Fp8Linear
    from dspark_trt.models.mxfp4_linear import Mxfp4Linear
    pair = get_preset("deepseek-v4-tiny-dspark")
    target, draft = build_models(pair, seed=1)
    write_checkpoint(tmp_path, pair.draft.to_hf(), v4_checkpoint_tensors(target, draft, quantize=False))
    _, t8, _ = load_pair(tmp_path, tmp_path, quantization="fp8")
    wide = dict(target.named_modules())
    fp8 = {n: m for n, m in t8.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8
    for n, m in fp8.items():
        w = wide[n].weight.float()
        s = m.weight_scale_inv
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))        # powers of two (E8M0)
        d = dequant_fp8_block(m.weight, s.log2().add(127).round().to(torch.uint8))
        assert ((d - w).abs() <= w.abs() * 2 ** -4 + w.abs().max() * 2 ** -9).all(), n
    mx = {n: m for n, m in t8.named_modules() if isinstance(m, Mxfp4Linear)}
    assert len(mx) == 3 * 8 * 5
    for n, m in mx.items():
        w = wide[n].weight.float()
        assert all(torch.equal(a, b) for a, b in zip((m.weight, m.weight_scale), quant_mxfp4_u8(w))), n
        grid = e8m0_to_float(m.weight_scale).repeat_interleave(32, 1)       # one E2M1 unit at most
        assert ((dequant_mxfp4(m.weight, m.weight_scale) - w).abs() <= grid).all(), n


def test_native_fp8_keeps_fp32_scales_and_names_a_bad_one():
    """``_native_fp8`` (an Fp8Linear parameter of a V4 load): E8M0 scales become fp32, fp32 scales
    stay as stored, a scale of the wrong shape is a CheckpointError naming the tensor."""
    from dspark_trt.checkpoints.v4 import _native_fp8
    q, s = quant_fp8_block(torch.randn(200, 300, generator=torch.Generator().manual_seed(2)))
    w, got = _native_fp8("a.weight", q, {"a.weight_scale_inv": s}, "a.weight' in f")
    assert w is q and torch.equal(got, e8m0_to_float(s))
    fp32 = e8m0_to_float(s) * 1.5
    assert torch.equal(_native_fp8("a.weight", q, {"a.weight_scale_inv": fp32}, "x")[1], fp32)
    with pytest.raises(CheckpointError, match="a.weight' in f.*scale has shape"):
        _native_fp8("a.weight", q, {"a.weight_scale_inv": s[:1]}, "a.weight' in f")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp4_experts_on_gpu_run_the_kernel(tiny_checkpoint, monkeypatch):
    """On CUDA the stacked MXFP4 experts run the Triton kernel (its calls are counted). fp32
    activations: logits within 1e-3 of the largest logit of the dequantising load (the experts'
    products are the same; the fp8 linears' kernel and the summation orders are not);
    speculative greedy == autoregressive greedy of the MXFP4 target, token for token."""
    from dspark_trt.plugins.kernels import moe as kmoe
    calls, orig = [], kmoe.moe_experts_mxfp4_triton
    monkeypatch.setattr(kmoe, "moe_experts_mxfp4_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    native, _, a, b = _native_vs_dequantised(tiny_checkpoint[0], "cuda", torch.float32)
    assert calls, "the MXFP4 kernel did not run"
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
    assert _greedy(native, True) == _greedy(native, False)
