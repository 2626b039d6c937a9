"""Options shared by several sub-commands: which model, dtype, device (``config.ModelSource``)."""
from __future__ import annotations

import argparse
import os
import sys

from ..config.source import DEFAULT_ASSETS, ModelSource, add_source_args, default_pair_dirs  # noqa: F401
from ..devices import cpu_dtype_note  # noqa: F401  (generate's note)

MODEL_FLAGS = ("model", "checkpoint", "draft_checkpoint", "engine", "dtype", "device", "num_spec_tokens",
               "max_batch_size", "max_seq_len", "markov_sampler", "draft_vocab", "kv_cache_dtype", "quantization",
               "draft_quantization", "verify_cost_model", "tp_size", "expert_parallel")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_source_args(p.add_argument_group("model"), MODEL_FLAGS)


def _say_on_rank0(note: str) -> None:
    """A note on stderr (stdout carries results only), once under torchrun."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(note, file=sys.stderr)


def load_llm(args, **kw):
    """Build an LLM from the ``add_model_args`` options (``LLM.from_source``: --engine,
    --checkpoint/--draft-checkpoint, --model, or the built-in default pair; ``kw``: more ``LLM``
    options, e.g. ``compile``). Under torchrun every rank loads; only rank 0 prints."""
    from ..runtime.llm import LLM
    src = ModelSource.from_args(args)
    if src.tp_size > 1 and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")             # every rank runs; rank 0 prints
    graphs = getattr(args, "cuda_graphs", "auto")
    return LLM.from_source(src, cuda_graphs=None if graphs == "auto" else graphs == "on",
                           say=_say_on_rank0, **kw)
