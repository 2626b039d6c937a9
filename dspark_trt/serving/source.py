"""Which model an instance serves: ``ServedModel`` = ``config.ModelSource`` + ``speculative``, as
CLI arguments <-> config.pbtxt parameters -> ``LLM``.

The model is built by ``LLM.from_source``, the same code path as ``dspark-trt generate``:
``--engine DIR`` (``LLM.from_engine``), ``--checkpoint DIR --draft-checkpoint DIR``, or
``--model PRESET --random-weights``; with none of them, the built-in default pair (as ``generate``).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

from ..config.source import (DEFAULT_ASSETS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, ModelSource,
                             default_pair_dirs)


@dataclass
class ServedModel(ModelSource):
    max_batch_size: int | None = DEFAULT_MAX_BATCH_SIZE   # sequences in the runtime's continuous batch
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN
    speculative: bool = True
    # tp_size > 1: this instance leads tp_size ranks (parallel/replica.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServedModel":
        """From ``add_model_args`` options; paths become absolute, the choice is checked."""
        def path(p):
            return str(Path(p).resolve()) if p else None
        checkpoint, draft = args.checkpoint, args.draft_checkpoint
        if not (args.engine or checkpoint or draft or args.model):
            pair = default_pair_dirs()
            if pair is None:
                raise SystemExit("error: give a model source: --engine DIR, --checkpoint DIR "
                                 f"--draft-checkpoint DIR, or --model PRESET --random-weights (the built-in "
                                 f"default pair is not in {DEFAULT_ASSETS})")
            checkpoint, draft = pair
            print(f"[dspark-trt] no model source given: the built-in default pair ({DEFAULT_ASSETS})")
        src = super().from_args(args, engine=path(args.engine), checkpoint=path(checkpoint),
                                draft_checkpoint=path(draft), draft_vocab=path(getattr(args, "draft_vocab", None)),
                                max_batch_size=args.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
                                max_seq_len=args.max_seq_len or DEFAULT_MAX_SEQ_LEN,
                                tp_size=getattr(args, "tp_size", 1) or 1,
                                speculative=not getattr(args, "no_speculative", False))
        return src.validate()

    def validate(self) -> "ServedModel":
        given = [n for n, v in (("--engine", self.engine), ("--checkpoint", self.checkpoint),
                                ("--model", self.model)) if v]
        if len(given) != 1:
            raise SystemExit("error: give exactly one model source: --engine DIR, "
                             "--checkpoint DIR --draft-checkpoint DIR, or --model PRESET --random-weights"
                             + (f" (got {', '.join(given)})" if given else ""))
        if bool(self.checkpoint) != bool(self.draft_checkpoint):
            raise SystemExit("error: --checkpoint and --draft-checkpoint go together")
        if self.model and not self.random_weights:
            raise SystemExit(f"error: preset '{self.model}' has no weights; add --random-weights to serve "
                             "random weights, or give --checkpoint/--draft-checkpoint or --engine")
        for p in (self.engine, self.checkpoint, self.draft_checkpoint):
            if p and not Path(p).is_dir():
                raise SystemExit(f"error: {p} is not a directory")
        if self.tp_size < 1:
            raise SystemExit(f"error: --tp-size must be >= 1, got {self.tp_size}")
        if self.max_batch_size <= 0 or self.max_seq_len <= 0:
            raise SystemExit("error: --max-batch-size and --max-seq-len must be positive")
        return self

    def to_parameters(self) -> dict[str, str]:
        return {f.name: _str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServedModel":
        """From config.pbtxt string parameters (unknown keys are ignored; "" is None)."""
        kw = {}
        for f in fields(cls):
            if f.name in params:
                raw = params[f.name]
                kw[f.name] = (None if raw == "" and "None" in f.type else
                              raw.lower() == "true" if f.type == "bool" else
                              int(raw) if f.type.startswith("int") else raw)
        return cls(**kw)

    def load(self, device: str | None = None):
        """Build the ``LLM`` (``device`` overrides, e.g. ``cuda:1`` for a KIND_GPU instance)."""
        from ..runtime.llm import LLM
        return LLM.from_source(dataclasses.replace(self, device=device or self.device))


def _str(v) -> str:
    return "" if v is None else ("true" if v else "false") if isinstance(v, bool) else str(v)
