"""Options shared by several sub-commands: which model, dtype, device."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
DEFAULT_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "default"
FALLBACK_PRESET = "qwen3-tiny-dspark"
RANDOM_WEIGHTS_NOTE = "acceptance will be low, tau near 1; text is noise"
# bf16 on a CPU with native bf16 (AMX / AVX512-BF16) is faster, but measured on the default pair
# (2-core AVX512-BF16 CPU, #18): greedy speculative output differed from greedy plain decoding on
# 3 of 3 prompts within 128 tokens (bf16 near-ties: fp32 top-2 margins 0.08-0.14 at logits
# 14-20, where one bf16 step is 0.125), so the CPU default stays fp32 and bf16 is opt-in.
CPU_BF16_DEFAULT = False


class Unset(int):
    """A default the user did not give (an int like any other): an engine's own limit wins."""


def given(value):
    """``value`` if the user gave it, else None."""
    return None if isinstance(value, Unset) else value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="preset name (random weights unless checkpoints are given)")
    g.add_argument("--checkpoint", help="target HF checkpoint directory")
    g.add_argument("--draft-checkpoint", help="draft HF checkpoint directory")
    g.add_argument("--engine", help="engine directory built by `dspark-trt build`")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--num-spec-tokens", type=int, default=None,
                   help="N drafts per round (default: the draft's block size; an engine's is fixed)")
    g.add_argument("--max-batch-size", type=int, default=Unset(8),
                   help="default: %(default)s (an engine's own)")
    g.add_argument("--max-seq-len", type=int, default=Unset(2048),
                   help="prompt + new tokens (default: %(default)s or the model's context if "
                        "shorter; an engine's own)")
    g.add_argument("--markov-sampler", choices=["exact", "topk"], default=None,
                   help="draft block sampler: exact (default) or topk (fast, lossless); engines "
                        "have theirs compiled in")
    g.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks; launch with `torchrun --nproc-per-node TP -m dspark_trt.cli`")
    g.add_argument("--expert-parallel", action="store_true",
                   help="with --tp-size: split MoE experts across the ranks by expert (attention "
                        "stays tensor-parallel); see docs/parallel.md")


def default_pair_dirs() -> tuple[Path, Path] | None:
    t, d = DEFAULT_ASSETS / "target", DEFAULT_ASSETS / "draft"
    return (t, d) if (t / "config.json").exists() and (d / "config.json").exists() else None


def default_dtype(device: str, flags: list[str] | None = None) -> torch.dtype:
    """bf16 on CUDA; on a CPU fp32, or bf16 where the CPU has native bf16 (``flags``: its bf16
    instruction sets, default: read from /proc/cpuinfo) and ``CPU_BF16_DEFAULT`` is on."""
    if device.startswith("cuda"):
        return torch.bfloat16
    from ..devices import cpu_bf16_flags
    flags = cpu_bf16_flags() if flags is None else flags
    return torch.bfloat16 if flags and CPU_BF16_DEFAULT else torch.float32


def cpu_dtype_note(dtype: torch.dtype, flags: list[str] | None = None) -> str | None:
    """One line saying which dtype a CPU run uses by default and why, on a CPU with native bf16
    (None elsewhere: fp32 needs no word)."""
    from ..devices import cpu_bf16_flags
    flags = cpu_bf16_flags() if flags is None else flags
    if not flags:
        return None
    if dtype == torch.bfloat16:
        return f"[dspark-trt] CPU has native bf16 ({', '.join(flags)}): using bf16 (--dtype fp32 for fp32)"
    return (f"[dspark-trt] CPU has native bf16 ({', '.join(flags)}) but fp32 is the default: in "
            "bf16, greedy speculative output can differ from plain decoding on near-ties "
            "(--dtype bf16 for speed)")


def load_llm(args):
    """Build an LLM from --engine, --checkpoint/--draft-checkpoint, --model, or the default.
    Names and the device are checked before anything loads (``ConfigError``)."""
    from ..config import get_preset
    from ..devices import resolve_device
    from ..runtime.llm import LLM
    device = str(resolve_device(args.device))
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    kw = dict(max_batch_size=given(args.max_batch_size), max_seq_len=given(args.max_seq_len),
              markov_sampler=getattr(args, "markov_sampler", None))
    graphs = getattr(args, "cuda_graphs", "auto")
    if graphs != "auto":
        kw["cuda_graphs"] = graphs == "on"
    tp_size = getattr(args, "tp_size", 1)
    if tp_size > 1 and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")             # every rank runs; rank 0 prints
    if getattr(args, "engine", None):
        return LLM.from_engine(args.engine, device=device, tp_size=tp_size,
                               num_spec_tokens=args.num_spec_tokens, **kw)
    kw["max_batch_size"] = kw["max_batch_size"] or int(args.max_batch_size)   # the default
    kw["tp_size"] = tp_size
    if getattr(args, "expert_parallel", False):
        if tp_size == 1:
            raise SystemExit("error: --expert-parallel needs --tp-size > 1 (under torchrun)")
        kw["expert_parallel"] = True
    if args.checkpoint or args.draft_checkpoint:
        if not (args.checkpoint and args.draft_checkpoint):
            raise SystemExit("error: --checkpoint and --draft-checkpoint go together")
        return LLM.from_checkpoints(args.checkpoint, args.draft_checkpoint, dtype=dtype, device=device,
                                    num_spec_tokens=args.num_spec_tokens, **kw)
    if args.model is None and default_pair_dirs() is not None:
        t, d = default_pair_dirs()
        print(f"[dspark-trt] using the built-in default pair ({DEFAULT_ASSETS})", file=sys.stderr)
        return LLM.from_checkpoints(t, d, dtype=dtype, device=device,
                                    num_spec_tokens=args.num_spec_tokens, **kw)
    name = args.model or FALLBACK_PRESET
    get_preset(name).check_limits(kw["max_batch_size"], kw["max_seq_len"])   # before the notice
    print(f"[dspark-trt] no checkpoint given: preset '{name}' with RANDOM weights on {device} "
          f"({RANDOM_WEIGHTS_NOTE})", file=sys.stderr)
    return LLM.from_preset(name, dtype=dtype, device=device, num_spec_tokens=args.num_spec_tokens, **kw)
