"""``--draft-quantization fp8``: a Qwen3 DSpark draft's attention / MLP projections in fp8 e4m3 with
128x128 block scales (weight-only), the target untouched, the speculative loop lossless."""
from __future__ import annotations

import pytest
import torch

from dspark_trt import cli
from dspark_trt.checkpoints.fp8 import check_draft_quantization
from dspark_trt.checkpoints.loaders import load_pair
from dspark_trt.config import ConfigError
from dspark_trt.config.source import ModelSource, default_pair_dirs
from dspark_trt.models.fp8_linear import Fp8Linear
from dspark_trt.models.fuse import FusedFp8Linear
from dspark_trt.plugins.fp8_linear import dequantize_fp8
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

PROMPTS = ["def parse(self, text):", "import os\nimport sys\n\n", "class Reader:\n    def __init__(self"]


def _build_options(**kw):
    from dspark_trt.builder.build import BuildOptions
    return BuildOptions(model="qwen3-tiny-dspark", random_weights=True, dtype="fp32", device="cpu", output="unused",
                        **kw).resolved()


def _llm(mode):
    return LLM.from_checkpoints(*default_pair_dirs(), device="cpu", dtype=torch.float32, draft_quantization=mode,
                                max_batch_size=4, max_seq_len=160)


def test_fp8_draft_quantises_the_draft_only_and_stays_lossless():
    """Every attention / MLP projection of the draft (fused q/k/v and gate/up included) holds fp8
    codes whose dequantised weights differ from the trained ones by at most e4m3's half step
    (1/16 of a block's largest); the target keeps its weights; the bench's roofline counts the
    draft's projections as fp8; greedy speculative output equals the target's own greedy output,
    with either draft."""
    fp8, plain = _llm("fp8"), _llm(None)
    fp8_types = (Fp8Linear, FusedFp8Linear)
    assert not any(isinstance(m, fp8_types) for m in fp8.target.modules())
    assert not any(isinstance(m, fp8_types) for m in plain.draft.modules())
    _, _, trained = load_pair(*default_pair_dirs(), torch.float32, "cpu")
    quantised = {n: m for n, m in fp8.draft.named_modules() if isinstance(m, fp8_types)}
    layers = len(trained.layers)
    assert len(quantised) == 4 * layers                    # q/k/v, o, gate/up, down per layer (fused)
    for n, m in quantised.items():
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        prefix, leaf = n.rsplit(".", 1)
        w = torch.cat([trained.get_submodule(f"{prefix}.{p}").weight for p in parts.get(leaf, (leaf,))])
        deq = dequantize_fp8(m.weight, m.weight_scale_inv, torch.float32)
        assert deq.shape == w.shape and not torch.equal(deq, w)
        assert float((deq - w).abs().max()) <= float(w.abs().max()) / 16, n
    from dspark_trt.commands.bench import qwen3_weight_bytes, roofline     # the draft step's bytes as held
    dc, el = fp8.pair.draft.layer_config(), 4
    saved = (qwen3_weight_bytes(dc, dc.num_hidden_layers, el, with_head=False)
             - qwen3_weight_bytes(dc, dc.num_hidden_layers, el, with_head=False, fp8_projections=True))
    assert saved > 0 and roofline(plain, 1, 64, 4.8)["draft_weight_bytes"] - \
        roofline(fp8, 1, 64, 4.8)["draft_weight_bytes"] == saved
    sp = SamplingParams(max_new_tokens=24)
    ar = [o.output_ids for o in plain.generate(PROMPTS, sp, speculative=False)]
    assert [o.output_ids for o in fp8.generate(PROMPTS, sp)] == ar
    assert [o.output_ids for o in fp8.generate(PROMPTS, sp, speculative=False)] == ar


@pytest.mark.parametrize("call,match", [
    (lambda: check_draft_quantization("int4"), r"--draft-quantization 'int4': choose one of none, fp8"),
    (lambda: check_draft_quantization("fp8", "deepseek_v4_dspark"), "Qwen3 targets only"),
    (lambda: check_draft_quantization("fp8", None, tp_size=2), "not with tensor parallelism yet"),
    (lambda: LLM.from_source(ModelSource(engine="/nonexistent", draft_quantization="fp8", device="cpu")),
     "an engine's draft weights are compiled in"),
    (lambda: LLM.from_preset("qwen3-tiny-dspark", device="cpu", draft_quantization="int8"), "'int8'"),
    (lambda: _build_options(draft_quantization="fp8", tp_size=2), "not with tensor parallelism yet"),
    (lambda: _build_options(draft_quantization="int4"), "'int4'"),
])
def test_bad_draft_quantization_is_named(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_cli_takes_draft_quantization():
    args = cli.build_parser().parse_args(["generate", "--draft-quantization", "fp8"])
    assert ModelSource.from_args(args).draft_quantization == "fp8"
    assert cli.build_parser().parse_args(["bench"]).draft_quantization is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--draft-quantization", "int4"])


def test_fp8_draft_block_exports_with_its_projections_in_fp8_and_runs_like_eager():
    """``dspark-trt build --draft-quantization fp8``: the exported draft block keeps the draft's
    projections as float8_e4m3fn parameters read by ``dspark::fp8_linear`` (the engine holds the fp8
    bytes), and gives the eager block's outputs bit for bit; the build's command line and options
    (the engine's manifest) say so."""
    from dspark_trt.builder.build import load_models
    from dspark_trt.builder.export import BuildShapes, export_network, network_specs
    o = _build_options(draft_quantization="fp8")
    assert "--draft-quantization fp8" in o.command_line()
    _, target, draft = load_models(o, torch.float32, torch.device("cpu"))
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, draft.config.block_size, o.page_size)
    spec = next(s for s in network_specs(target, draft, shapes, torch.float32, torch.device("cpu"))
                if s.name == "draft_block")
    ep, ops = export_network(spec, set())
    assert ops.get("dspark::fp8_linear") == "kernel", ops
    fp8 = [n for n, t in ep.state_dict.items() if t.dtype == torch.float8_e4m3fn]
    assert fp8 and sum(ep.state_dict[n].numel() for n in fp8) == sum(
        p.numel() for p in draft.parameters() if p.dtype == torch.float8_e4m3fn)
    assert not any(p.dtype == torch.float8_e4m3fn for p in target.parameters())
    with torch.no_grad():
        want, got = spec.module(*spec.args), ep.module()(*spec.args)
    for a, b in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)
