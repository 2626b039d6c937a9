"""CPU dtype of `dspark-trt generate` (#18): native-bf16 CPUs are detected from /proc/cpuinfo;
bf16 becomes the CPU default only under ``CPU_BF16_DEFAULT``, which needs greedy speculative ==
greedy plain decoding in bf16 on the default pair."""
import pytest
import torch

from dspark_trt.commands import common
from dspark_trt.devices import cpu_bf16_flags

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\nprocessor\t: 1\n"


def test_bf16_flags_parsed_from_cpuinfo():
    assert cpu_bf16_flags(CPUINFO) == ["avx512_bf16"]
    assert cpu_bf16_flags(CPUINFO.replace("amx_tile", "amx_bf16")) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags("flags : fpu sse2 avx2\n") == []


def test_default_dtype_policy(capsys, monkeypatch):
    assert common.default_dtype("cuda:0", say=True, flags=[]) == torch.bfloat16
    assert common.default_dtype("cpu", say=True, flags=[]) == torch.float32
    assert capsys.readouterr().err == ""                    # nothing to say without native bf16
    monkeypatch.setattr(common, "CPU_BF16_DEFAULT", False)
    assert common.default_dtype("cpu", say=True, flags=["avx512_bf16"]) == torch.float32
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "avx512_bf16" in err and "--dtype bf16" in err
    monkeypatch.setattr(common, "CPU_BF16_DEFAULT", True)
    assert common.default_dtype("cpu", say=True, flags=["amx_bf16"]) == torch.bfloat16
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "using bf16" in err and "--dtype fp32" in err


@pytest.mark.skipif(not common.CPU_BF16_DEFAULT or common.default_pair_dirs() is None,
                    reason="CPU default is fp32: bf16 near-ties made greedy speculative output "
                           "differ from plain decoding on the default pair (commands/common.py)")
def test_bf16_default_keeps_greedy_speculative_lossless():
    from dspark_trt import LLM, SamplingParams
    target, draft = common.default_pair_dirs()
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
               "import os\nimport sys\n\n\ndef main(argv):\n"]
    llm = LLM.from_checkpoints(target, draft, device="cpu", dtype=torch.bfloat16, max_batch_size=1,
                               max_seq_len=256)
    sp = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    for p in prompts:
        assert llm.generate([p], sp)[0].output_ids == llm.generate([p], sp, speculative=False)[0].output_ids
