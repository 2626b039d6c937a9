"""CPU dtype of `dspark-trt generate` (#18): native-bf16 CPUs are detected from /proc/cpuinfo;
bf16 becomes the CPU default only under ``CPU_BF16_DEFAULT``, which needs greedy speculative ==
greedy plain decoding in bf16 on the default pair."""
import pytest
import torch

from dspark_trt import devices as common
from dspark_trt.config.source import default_pair_dirs
from dspark_trt.devices import cpu_bf16_flags

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\nprocessor\t: 1\n"


def test_bf16_flags_parsed_from_cpuinfo():
    assert cpu_bf16_flags(CPUINFO) == ["avx512_bf16"]
    assert cpu_bf16_flags(CPUINFO.replace("amx_tile", "amx_bf16")) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags("flags : fpu sse2 avx2\n") == []


def test_default_dtype_policy_and_note(monkeypatch):
    assert common.default_dtype("cuda:0", flags=[]) == torch.bfloat16
    assert common.default_dtype("cpu", flags=[]) == torch.float32
    assert common.cpu_dtype_note(torch.float32, flags=[]) is None   # nothing to say
    monkeypatch.setattr(common, "CPU_BF16_DEFAULT", False)
    assert common.default_dtype("cpu", flags=["avx512_bf16"]) == torch.float32
    note = common.cpu_dtype_note(torch.float32, flags=["avx512_bf16"])
    assert "\n" not in note and "avx512_bf16" in note and "--dtype bf16" in note
    monkeypatch.setattr(common, "CPU_BF16_DEFAULT", True)
    assert common.default_dtype("cpu", flags=["amx_bf16"]) == torch.bfloat16
    note = common.cpu_dtype_note(torch.bfloat16, flags=["amx_bf16"])
    assert "\n" not in note and "using bf16" in note and "--dtype fp32" in note


def test_generate_says_the_cpu_dtype_in_one_line(capsys, monkeypatch):
    from dspark_trt.cli import main
    import dspark_trt.devices as devices
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: ["avx512_bf16"])
    args = ["generate", "--model", "qwen3-tiny-dspark", "--device", "cpu", "--prompt-ids", "1,2",
            "--max-new-tokens", "4"]
    assert main(args) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "native bf16" in ln]
    assert len(lines) == 1 and "fp32 is the default" in lines[0]
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: [])
    assert main(args + ["--dtype", "bf16"]) == 0
    cap = capsys.readouterr()
    assert "native bf16" not in cap.out + cap.err


@pytest.mark.skipif(not common.CPU_BF16_DEFAULT or default_pair_dirs() is None,
                    reason="CPU default is fp32: bf16 near-ties made greedy speculative output "
                           "differ from plain decoding on the default pair (devices.py)")
def test_bf16_default_keeps_greedy_speculative_lossless():
    from dspark_trt import LLM, SamplingParams
    target, draft = default_pair_dirs()
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
               "import os\nimport sys\n\n\ndef main(argv):\n"]
    llm = LLM.from_checkpoints(target, draft, device="cpu", dtype=torch.bfloat16, max_batch_size=1,
                               max_seq_len=256)
    sp = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    for p in prompts:
        assert llm.generate([p], sp)[0].output_ids == llm.generate([p], sp, speculative=False)[0].output_ids
