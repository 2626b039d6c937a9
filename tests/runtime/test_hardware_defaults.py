"""Defaults that fit the hardware (#22): dtype "auto" (the checkpoint's, fp32 for bf16 / fp16 on a
CPU with one note, the device's for random weights, explicit wins, a bad name is refused naming
the field) and max_seq_len from the model's context, capped to what the KV pages hold (and to
2,048 where a wide block table costs every step: a CPU, DeepSeek-V4)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import dspark_trt.devices as devices
import dspark_trt.runtime.llm as llm_mod
from dspark_trt.config import ConfigError, ModelPair
from dspark_trt.config.dtypes import stored_dtype
from dspark_trt.config.source import DEFAULT_MAX_SEQ_LEN, ModelSource, default_pair_dirs, source_context
from dspark_trt.devices import resolve_dtype
from dspark_trt.models import build_models
from dspark_trt.runtime.kv_manager import table_width_cost
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams

from tests.support.models import tiny_pair

needs_pair = pytest.mark.skipif(default_pair_dirs() is None, reason="the default pair is not shipped here")


# ---- dtype ---------------------------------------------------------------------------------

def test_stored_dtype_reads_torch_dtype_or_dtype():
    assert stored_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert stored_dtype({"dtype": "float16"}) == torch.float16          # newer transformers
    assert stored_dtype({"torch_dtype": "torch.float32"}) == torch.float32
    assert stored_dtype({}) is None and stored_dtype({"torch_dtype": "float8_e4m3fn"}) is None


def test_auto_dtype_policy(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: [])
    assert resolve_dtype("auto", "cuda:0", torch.bfloat16) == (torch.bfloat16, None)
    assert resolve_dtype(None, "cuda", torch.float16) == (torch.float16, None)
    assert resolve_dtype(None, "cuda", None) == (torch.bfloat16, None)      # random weights
    assert resolve_dtype("auto", "cpu", None) == (torch.float32, None)
    assert resolve_dtype("auto", "cpu", torch.float64) == (torch.float64, None)   # as stored
    dt, note = resolve_dtype("auto", "cpu", torch.bfloat16)                 # the CPU rule
    assert dt == torch.float32 and "\n" not in note and "bfloat16" in note and "--dtype bf16" in note
    assert resolve_dtype("bf16", "cpu", torch.bfloat16) == (torch.bfloat16, None)   # explicit wins
    assert resolve_dtype("fp32", "cuda", torch.bfloat16) == (torch.float32, None)
    assert resolve_dtype(torch.float16, "cpu", torch.bfloat16) == (torch.float16, None)
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: ["avx512_bf16"])
    dt, note = resolve_dtype("auto", "cpu", torch.bfloat16)                 # generate's note, as before
    assert dt == torch.float32 and "fp32 is the default" in note
    for bad in ("fp8", "float32", 3):
        with pytest.raises(ConfigError, match=r"dtype .* \(--dtype\): choose one of auto, fp32"):
            resolve_dtype(bad, "cpu")


@needs_pair
def test_checkpoints_auto_dtype_on_cpu_and_explicit(monkeypatch):
    target, draft = default_pair_dirs()                                     # stored bf16
    assert LLM.from_checkpoints(target, draft, device="cpu", max_batch_size=1).dtype == torch.float32
    llm = LLM.from_checkpoints(target, draft, device="cpu", dtype="bf16", max_batch_size=1)
    assert llm.dtype == torch.bfloat16 and next(llm.target.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype 'bfloat' .--dtype."):
        LLM.from_checkpoints(target, draft, device="cpu", dtype="bfloat")
    with pytest.raises(ConfigError, match="dtype 'int8' .--dtype."):           # before loading
        LLM.from_source(ModelSource(dtype="int8", device="cpu"), say=lambda _: None)


@needs_pair
def test_generate_notes_the_cpu_dtype_once_and_explicit_dtype_wins(capsys, monkeypatch):
    from dspark_trt.cli import main
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: [])
    args = ["generate", "--device", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert main(args) == 0
    cap = capsys.readouterr()
    notes = [ln for ln in cap.err.splitlines() if "on the CPU" in ln]
    assert len(notes) == 1 and "bfloat16" in notes[0] and "float32" in notes[0], cap.err
    assert "on the CPU" not in cap.out
    assert main(args + ["--dtype", "bf16"]) == 0
    assert "on the CPU" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                                      # argparse names it
        main(args + ["--dtype", "fp8"])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err


# ---- max_seq_len ---------------------------------------------------------------------------

def _tiny(context: int):
    pair = tiny_pair(block=4)
    pair = ModelPair(pair.name, dataclasses.replace(pair.target, max_position_embeddings=context),
                     pair.draft)
    target, draft = build_models(pair, torch.float32, "cpu", seed=3)
    return pair, target, draft


@pytest.fixture
def cheap_width(monkeypatch):
    """As on CUDA with Qwen3: a wide block table costs no step time (the Triton block attention
    reads each sequence up to its length), so the default is the model's context."""
    monkeypatch.setattr(llm_mod, "table_width_cost", lambda pair, device: None)


def test_table_width_cost_by_device_and_model():
    from dspark_trt.config import get_preset
    qwen, v4 = get_preset("qwen3-tiny-dspark"), get_preset("deepseek-v4-tiny-dspark")
    assert table_width_cost(qwen, "cuda") is None
    assert "CPU" in table_width_cost(qwen, "cpu") and "V4" in table_width_cost(v4, "cuda")


def test_cpu_default_max_seq_len_stays_short_with_the_reason(caplog):
    pair, target, draft = _tiny(4096)
    with caplog.at_level(logging.INFO):
        llm = LLM(pair, target, draft, max_batch_size=1, page_size=16)
    assert llm.max_seq_len == DEFAULT_MAX_SEQ_LEN == 2048
    assert "the model's context is 4096" in caplog.text and "CPU" in caplog.text
    assert LLM(pair, target, draft, max_batch_size=1, page_size=16, max_seq_len=4096).max_seq_len == 4096


def test_default_max_seq_len_is_the_context_where_the_kv_pages_hold_it(caplog, cheap_width):
    pair, target, draft = _tiny(4096)       # N = 4: headroom 5; default pool: batch x 2048 tokens
    with caplog.at_level(logging.WARNING):
        llm = LLM(pair, target, draft, max_batch_size=4, page_size=16)
    assert llm.networks.num_pages == 4 * -(-(2048 + 5) // 16)              # memory as before
    assert llm.max_seq_len == 4096 and "max_seq_len" not in caplog.text
    assert llm.max_pages_per_seq == -(-(4096 + 5) // 16)
    assert LLM(pair, target, draft, max_batch_size=4, page_size=16, max_seq_len=300).max_seq_len == 300


def test_default_max_seq_len_is_capped_to_the_kv_pages_with_the_reason(caplog, cheap_width):
    pair, target, draft = _tiny(4096)
    with caplog.at_level(logging.WARNING):
        llm = LLM(pair, target, draft, max_batch_size=1, page_size=16)      # 129 pages: 2064 tokens
    assert llm.max_seq_len == 129 * 16 - 5 and llm.max_pages_per_seq == 129
    assert "instead of 4096 tokens (the model's context)" in caplog.text and "129 pages" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        small = LLM(pair, target, draft, max_batch_size=2, page_size=16, num_pages=8)
    assert small.max_seq_len == 8 * 16 - 5 and "instead of 4096" in caplog.text
    gen = small.scheduler()
    with pytest.raises(RequestError, match=f"exceeds max_seq_len {8 * 16 - 5}"):
        gen.add_request([1, 2, 3], SamplingParams(max_new_tokens=8 * 16 - 7))
    out = small.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8 * 16 - 8, ignore_eos=True))[0]
    assert len(out.output_ids) == 8 * 16 - 8                                 # the capped maximum runs


@needs_pair
def test_source_context_is_read_before_loading():
    assert source_context(ModelSource()) == 4096                            # the default pair
    assert source_context(ModelSource(model="qwen3-tiny-dspark")) == 4096
    assert source_context(ModelSource(engine="x")) is None


# ---- on the GPU --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_pair
def test_cuda_defaults_are_the_checkpoints_dtype_and_context():
    """Default pair on CUDA: bf16 as stored, max_seq_len = its context (4,096) with the default KV
    pool; a request past the old 2,048 runs through the CUDA graphs of the wider block table, and
    a request past the context is refused."""
    target, draft = default_pair_dirs()
    llm = LLM.from_checkpoints(target, draft, device="cuda", max_batch_size=2, cuda_graphs=True)
    assert llm.dtype == torch.bfloat16 and llm.max_seq_len == 4096
    assert llm.max_pages_per_seq == -(-(4096 + llm.networks.num_spec_tokens + 1) // 64)
    prompt = [(7 * i) % 8000 + 2 for i in range(2100)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    assert len(out.output_ids) == 32 and out.finish_reason == "length"
    with pytest.raises(RequestError, match="exceeds max_seq_len 4096"):
        llm.generate([prompt], SamplingParams(max_new_tokens=4096 - 2100 + 1))


def test_hbm_bandwidth_by_gpu_name():
    """Rooflines use the GPU's own HBM rate: the H100 SXM's 3.35 TB/s is not taken for the H100
    PCIe's or NVL's, and an unknown GPU (or none) falls back to the H200's 4.8 TB/s."""
    from dspark_trt.devices import DEFAULT_HBM_BYTES_PER_S, hbm_bytes_per_s
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bytes_per_s("NVIDIA H100 NVL") == 3.9e12
    assert hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert hbm_bytes_per_s("Some GPU") == hbm_bytes_per_s("") == DEFAULT_HBM_BYTES_PER_S == 4.8e12
