"""dspark::moe_experts_mxfp4: its reference is moe_experts on the dequantised experts, its argument
checks name what is wrong, and its Triton kernels (``kernels/moe.py`` with the MXFP4 weight format)
match the reference under the Triton interpreter (one subprocess, ``plugins_cases.moe_mxfp4_cases``).

Tolerances: the reference against moe_experts on the same dequantised weights, 0 (the same
computation); fp32 kernels 1e-6 of the largest output (summation order); the ``tl.dot_scaled``
variant (bf16 x) at most twice the bf16 reference's error against the fp32 reference, + 1e-3 of
the largest output.
"""
from __future__ import annotations

import pytest
import torch

import dspark_trt.plugins  # noqa: F401
from dspark_trt.checkpoints.quant import dequant_mxfp4
from dspark_trt.plugins.moe_experts import moe_experts_ref
from dspark_trt.plugins.moe_experts_mxfp4 import dequantize_mxfp4, moe_experts_mxfp4_ref

from tests.support.interpreter import interpreter_results
from tests.support.plugins_cases import moe_mxfp4_inputs



def test_decoding_equals_the_checkpoint_decoder():
    """Every byte (both nibbles) under every finite non-zero exponent: the op's arithmetic E2M1 /
    exponent-bit decoding equals ``checkpoints.quant.dequant_mxfp4``'s table lookup."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(254, 1)     # [254, 256] -> 512 cols
    scale = torch.arange(1, 255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 16)   # row 126: 2^0
    got = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(got, dequant_mxfp4(packed.view(torch.int8), scale))
    assert torch.equal(got[126, :16], torch.tensor([0, 0, .5, 0, 1, 0, 1.5, 0, 2, 0, 3, 0, 4, 0, 6, 0]))


def test_reference_is_moe_experts_on_dequantised_experts():
    x, ids, w, w13p, w13s, w2p, w2s, first, limit = moe_mxfp4_inputs("cpu")
    w13, w2 = dequantize_mxfp4(w13p, w13s, x.dtype), dequantize_mxfp4(w2p, w2s, x.dtype)
    for lim in (limit, 0.0):
        got = torch.ops.dspark.moe_experts_mxfp4(x, ids, w, w13p, w13s, w2p, w2s, first, lim)   # CPU: the reference
        assert torch.equal(got, moe_experts_ref(x, ids, w, w13, w2, first, lim))
    assert not torch.equal(moe_experts_mxfp4_ref(x, ids, w, w13p, w13s, w2p, w2s, first, limit),
                           moe_experts_mxfp4_ref(x, ids, w, w13p, w13s, w2p, w2s, first, 0.0))   # the clamp bites


def test_bad_arguments_are_named():
    x, ids, w, w13p, w13s, w2p, w2s, first, limit = moe_mxfp4_inputs("cpu")      # E=5, d=64, h=32
    op = torch.ops.dspark.moe_experts_mxfp4
    cases = [((x, ids, w, w13p.float(), w13s, w2p, w2s), r"w13_packed must be 3-D uint8 / int8"),
             ((x, ids, w, w13p, w13s, w2p[..., :8], w2s), r"w2 \(5, 64, 8\) is not \[E=5, d=64, h/2=16\]"),
             ((x, ids, w, w13p[..., :16], w13s, w2p, w2s), r"w13 \(5, 64, 16\) is not \[E, 2h, d/2=32\]"),
             ((x, ids, w, w13p, w13s[..., :1], w2p, w2s), r"w13_scale is torch.uint8 \(5, 64, 1\), expected .*\(5, 64, 2\)"),
             ((x, ids, w, w13p, w13s, w2p, w2s.float()), r"w2_scale is torch.float32"),
             ((x, ids, w[:, :1], w13p, w13s, w2p, w2s), "routing_weights"),
             ((x[:, :48], ids, w, w13p[..., :24], w13s[..., :1], w2p[:, :48], w2s[:, :48]),
              "hidden size d=48 and intermediate size h=32 must be multiples of 32")]
    for args, match in cases:
        with pytest.raises(ValueError, match=f"dspark::moe_experts_mxfp4: {match}"):
            op(*args, first, limit)


def test_exports_as_one_node_with_dynamic_tokens():
    from torch.export import Dim

    class Moe(torch.nn.Module):
        def __init__(self, *weights):
            super().__init__()
            for n, t in zip(("w13p", "w13s", "w2p", "w2s"), weights):
                self.register_buffer(n, t)

        def forward(self, x, ids, w):
            return torch.ops.dspark.moe_experts_mxfp4(x, ids, w, self.w13p, self.w13s, self.w2p, self.w2s, 2, 0.7)

    x, ids, w, *weights, _, _ = moe_mxfp4_inputs("cpu")
    m = Moe(*weights)
    dim = Dim("m", min=1, max=512)
    ep = torch.export.export(m, (x, ids, w), dynamic_shapes=({0: dim}, {0: dim}, {0: dim}), strict=False)
    assert sum("moe_experts_mxfp4" in str(n.target) for n in ep.graph.nodes) == 1
    x2, ids2, w2, *_ = moe_mxfp4_inputs("cpu", M=11)
    assert torch.equal(ep.module()(x2, ids2, w2), m(x2, ids2, w2))


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    pytest.importorskip("triton", reason="Triton is not installed")
    return interpreter_results("tests.support.plugins_cases", "moe_mxfp4", timeout=300)


@pytest.mark.parametrize("case", ["moe_mxfp4", "moe_mxfp4_tiles", "moe_mxfp4_blocks", "moe_mxfp4_int8",
                                  "moe_mxfp4_aot", "moe_mxfp4_decode", "moe_mxfp4_decode_tiles",
                                  "moe_mxfp4_decode_bytes", "moe_mxfp4_decode_e4m3", "moe_mxfp4_decode_wide",
                                  "moe_mxfp4_decode_stages"])
def test_kernel_matches_reference_in_the_interpreter(kernel_results, case):
    r = kernel_results[case]
    assert r["scale"] > 1.0 and r["err"] <= 1e-6 * r["scale"], r


@pytest.mark.parametrize("decode", ["words", "bytes", "e4m3"])
def test_gemv_decodes_every_code_exactly_in_the_interpreter(kernel_results, decode):
    """All 16 E2M1 codes at each of the 8 positions of a word, x from 2^-60 to 2^60: exact
    (``tests/support/mxfp4_codes.py``)."""
    r = kernel_results[f"mxfp4_codes_{decode}"]
    assert r["exact"], r["runs"]


def test_dot_scaled_variant_in_the_interpreter(kernel_results):
    r = kernel_results["moe_mxfp4_dot_scaled"]
    assert r["err"] <= 2 * r["err16"] + 1e-3 * r["scale"], r


def test_decode_schedule_with_bf16_x_in_the_interpreter(kernel_results):
    """The GEMV schedule with bf16 x (what a decode step runs): as close to the fp32 reference as
    the bf16 reference is, plus 1e-3 of the scale (same rounding points, other summation order)."""
    r = kernel_results["moe_mxfp4_decode_bf16"]
    assert r["err"] <= 2 * r["err16"] + 1e-3 * r["scale"], r


def test_auto_decode_takes_the_fp8_conversion_on_sm89_gpus_only(monkeypatch):
    """``DSPARK_MXFP4_DECODE=auto`` (the default): ``e4m3`` on sm_89+ GPUs, ``words`` on older ones,
    on the CPU and under the interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import moe_decode
    assert moe_decode.MXFP4_DECODE in ("auto", *moe_decode.DECODES)
    monkeypatch.setattr(moe_decode, "INTERPRET", False)
    assert moe_decode.auto_decode(torch.device("cpu")) == "words"
    for cap, want in (((9, 0), "e4m3"), ((8, 9), "e4m3"), ((8, 6), "words"), ((8, 0), "words")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert moe_decode.auto_decode(torch.device("cuda", 0)) == want, cap
    monkeypatch.setattr(moe_decode, "INTERPRET", True)
    assert moe_decode.auto_decode(torch.device("cuda", 0)) == "words"


def test_pdl_capable_needs_an_sm90_gpu_and_gdc(monkeypatch):
    """``common.pdl_capable`` (the MoE decode's ``auto_pdl`` and the token step's chain): a CUDA
    device of sm_90+ with a Triton that has ``gdc_wait``; never the CPU or the interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import common
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "gdc_wait", object())
    assert not common.pdl_capable(torch.device("cpu"))
    for cap, want in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert common.pdl_capable(torch.device("cuda", 0)) is want, cap
    monkeypatch.setattr(common, "gdc_wait", None)
    assert not common.pdl_capable(torch.device("cuda", 0))
    monkeypatch.setattr(common, "gdc_wait", object())
    monkeypatch.setattr(common, "INTERPRET", True)
    assert not common.pdl_capable(torch.device("cuda", 0))


def test_schedule_arguments_are_checked():
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels.moe import moe_experts_mxfp4_triton
    args = moe_mxfp4_inputs("cpu")
    with pytest.raises(ValueError, match=r"\['block_m'\] do not apply to the decode schedule"):
        moe_experts_mxfp4_triton(*args, schedule="decode", block_m=16)
    with pytest.raises(ValueError, match=r"\['decode'\] do not apply to the grouped schedule"):
        moe_experts_mxfp4_triton(*args, schedule="grouped", decode="bytes")
    with pytest.raises(ValueError, match="decode must be one of \\['bytes', 'e4m3', 'words'\\] or auto, got 'fp16'"):
        moe_experts_mxfp4_triton(*args, schedule="decode", decode="fp16")
    with pytest.raises(ValueError, match=r"\['pdl'\] do not apply to the grouped schedule"):
        moe_experts_mxfp4_triton(*args, schedule="grouped", pdl=True)
    with pytest.raises(ValueError, match="moe decode: pdl=True needs a CUDA GPU"):
        moe_experts_mxfp4_triton(*args, schedule="decode", pdl=True)
    with pytest.raises(ValueError, match="maxnreg must be within 24..255 registers, got 8"):
        moe_experts_mxfp4_triton(*args, schedule="decode", maxnreg=8)
    with pytest.raises(ValueError, match=r"\['maxnreg'\] do not apply to the grouped schedule"):
        moe_experts_mxfp4_triton(*args, schedule="grouped", maxnreg=72)
    with pytest.raises(ValueError, match="schedule must be auto, grouped or decode, got 'gemv'"):
        moe_experts_mxfp4_triton(*args, schedule="gemv")
    with pytest.raises(ValueError, match="MXFP4 needs block_k a multiple of 32, got 48"):
        moe_experts_mxfp4_triton(*args, schedule="decode", block_k=48)
    with pytest.raises(ValueError, match=r"block_n \(weight rows per program, gate and up rows interleaved\) must be "
                                         ">= 2, got 1"):
        moe_experts_mxfp4_triton(*args, schedule="decode", block_n=1)
    with pytest.raises(ValueError, match="k_stages must be within 1..8, got 0"):
        moe_experts_mxfp4_triton(*args, schedule="decode", k_stages=0)
    with pytest.raises(ValueError, match=r"\['k_stages'\] do not apply to the grouped schedule"):
        moe_experts_mxfp4_triton(*args, schedule="grouped", k_stages=3)


def test_decode_tile_by_pair_count(monkeypatch):
    """MXFP4 GEMVs take the 32-row tile from ``DECODE_WIDE_PAIRS`` (token, slot) pairs on, the
    default below (an H100: one V4-Pro token 99.3 against 109.2 us, 16 tokens 1276 against 1207);
    bf16 keeps its one tile; a tile given by the caller wins. Checked on the launches made."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels import moe_decode as kmd
    from dspark_trt.plugins.kernels.moe import moe_experts_mxfp4_triton
    from tests.plugins.test_plugins_compile import _Recorder
    assert kmd.decode_tile(False, kmd.DECODE_WIDE_PAIRS - 1) == kmd.DECODE_DEFAULTS["mxfp4"]
    assert kmd.decode_tile(False, kmd.DECODE_WIDE_PAIRS) == kmd.DECODE_WIDE != kmd.DECODE_DEFAULTS["mxfp4"]
    assert kmd.decode_tile(True, 4 * kmd.DECODE_WIDE_PAIRS) == kmd.DECODE_DEFAULTS["dense"]
    assert 9 * 3 >= kmd.DECODE_WIDE_PAIRS          # the interpreter's moe_mxfp4_decode_wide case takes the wide tile
    launches = []
    monkeypatch.setattr(kmd, "launcher", _Recorder(launches))
    few, many = (kmd.DECODE_WIDE_PAIRS - 1) // 3, -(-kmd.DECODE_WIDE_PAIRS // 3)       # tokens of 3 slots
    for M, kw, want in ((few, {}, kmd.DECODE_DEFAULTS["mxfp4"]), (many, {}, kmd.DECODE_WIDE),
                        (many, {"block_n": 8}, {**kmd.DECODE_WIDE, "block_n": 8})):
        launches.clear()
        moe_experts_mxfp4_triton(*moe_mxfp4_inputs("cpu", M=M, k=3, E=8, d=512, h=256), schedule="decode", **kw)
        gate_up = next(kwargs for kernel, _, kwargs in launches if kernel is kmd.moe_decode_gate_up_kernel)
        assert (gate_up["BLOCK_N"], gate_up["BLOCK_K"], gate_up["num_warps"]) == (
            want["block_n"], want["block_k"], want["num_warps"]), (M, kw)


def test_dot_scaled_needs_a_16_bit_x():
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels.moe import moe_experts_mxfp4_triton
    args = moe_mxfp4_inputs("cpu")
    with pytest.raises(ValueError, match="dot_scaled needs bf16 / fp16 x and block_k a multiple of 32 "
                                         r"\(x torch.float32, block_k 64\)"):
        moe_experts_mxfp4_triton(*args, dot_scaled=True)
