"""Switch the default pair's ``dspark`` ops between their Triton kernels and their torch
references, in one process, and run a request's first rounds: the tools of
``interpreted_pair.py`` (the kernels on the CPU, interpreted) and ``kernel_bisect.py`` (on a GPU,
which op parts the rounds from the references'). Issue #25's batch-1 lead."""
from __future__ import annotations

import importlib
import pkgutil
import sys

import torch

from dspark_trt import plugins
from dspark_trt.config.source import default_pair_dirs
from dspark_trt.models.qwen3 import Qwen3DecoderLayer, use_row_kernels_
from dspark_trt.plugins import dispatch
from dspark_trt.runtime import SamplingParams
from dspark_trt.runtime.llm import LLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
USE_TRITON = dispatch.use_triton                # the device's own answer (the CPU's: the references)


def add_pair_arguments(ap, out_dir: str) -> None:
    """The options of the scripts that run the pair's first rounds: --dtype, --requests, --rounds,
    --out-dir."""
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--requests", default="0,2", help="indices into the steady load's held-out prompts")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out-dir", default=out_dir)


def load_pair(device: str, dtype: str, n_prompts: int, **kw) -> tuple[LLM, object]:
    """-> (the shipped default pair at batch 1, its first ``n_prompts`` held-out prompts), every
    window but N losing and AR never winning (``DRAFTING_PAYS``): fixed rounds only."""
    from priced_pair import DRAFTING_PAYS, PROMPT_LEN, prompts
    if default_pair_dirs() is None:
        raise SystemExit("error: the shipped default pair is missing")
    llm = LLM.from_checkpoints(*default_pair_dirs(), device=device, dtype=DTYPES[dtype], max_batch_size=1,
                               max_seq_len=PROMPT_LEN + 96, verify_cost=DRAFTING_PAYS, **kw)
    return llm, prompts(llm, n_prompts)


def triton_switches(skip: tuple[str, ...] = ()) -> list:
    """The modules that import dispatch's ``use_triton`` (every ``dspark_trt.plugins`` module
    imported first; TensorRT's need tensorrt), but dispatch itself and those named in ``skip``."""
    for m in pkgutil.walk_packages(plugins.__path__, "dspark_trt.plugins."):
        if not m.name.endswith("tensorrt") and "tensorrt_" not in m.name:
            importlib.import_module(m.name)
    return [mod for name, mod in list(sys.modules.items())
            if name.startswith(("dspark_trt.plugins", "dspark_trt.models")) and name != dispatch.__name__
            and getattr(mod, "use_triton", None) is USE_TRITON and not any(s in name for s in skip)]


def set_kernels(llm: LLM, modules: list, on: bool | None, row_kernels: bool) -> None:
    """Every op of ``modules`` on its Triton kernel (``on``), on its torch reference (False), or
    as the device decides (None: ``dispatch.use_triton``); with ``on`` and ``row_kernels`` the
    bf16 layers' row kernels too, else none."""
    for mod in modules:
        mod.use_triton = USE_TRITON if on is None else \
            (lambda x: dispatch.HAVE_TRITON) if on else (lambda x: False)
    nets = llm.networks
    for m in (nets.target_module, nets.draft_module):
        if on and row_kernels:
            use_row_kernels_(m)
        else:
            for layer in m.modules():
                if isinstance(layer, Qwen3DecoderLayer):
                    layer.row_kernels = layer.self_attn.row_kernels = layer.mlp.row_kernels = False


def first_rounds(llm: LLM, prompts, requests: list[int], rounds: int, tag: str = "interpreted-pair") -> dict:
    """Request -> drafts accepted in its first ``rounds`` rounds, its first tokens and its prompt's
    first ids (the same prompts on every device?)."""
    out = {}
    for i in requests:
        gen = llm.scheduler()
        seq = gen.add_request(prompts[i].tolist(), SamplingParams(max_new_tokens=64, ignore_eos=True))
        while gen.has_work() and len(seq.stats.accepted) < rounds:
            gen.step()
        out[i] = {"accepted": seq.stats.accepted, "tokens": seq.output_ids[:16], "prompt_head": prompts[i][:8].tolist()}
        print(f"[{tag}]   request {i}: accepted {seq.stats.accepted} tokens {seq.output_ids[:12]}", flush=True)
    return out
