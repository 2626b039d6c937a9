"""Which model an instance serves: CLI arguments <-> config.pbtxt parameters -> ``LLM``.

The model is built by ``commands.common.load_llm``, the same code path as ``dspark-trt generate``:
``--engine DIR`` (``LLM.from_engine``), ``--checkpoint DIR --draft-checkpoint DIR``, or
``--model PRESET --random-weights``; with none of them, the built-in default pair (as ``generate``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass
class ModelSource:
    engine: str = ""
    checkpoint: str = ""
    draft_checkpoint: str = ""
    model: str = ""                      # preset name (random weights)
    random_weights: bool = False
    dtype: str = ""                      # "" = load_llm's default for the device
    device: str = ""                     # "" = cuda when available
    num_spec_tokens: int = 0             # 0 = the draft's block size
    max_batch_size: int = 8              # sequences in the runtime's continuous batch
    max_seq_len: int = 2048
    speculative: bool = True
    tp_size: int = 1                     # > 1: this instance leads tp_size ranks (parallel/replica.py)
    expert_parallel: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelSource":
        """From ``add_model_args`` options; paths become absolute, the choice is checked."""
        def path(p):
            return str(Path(p).resolve()) if p else ""
        checkpoint, draft = args.checkpoint, args.draft_checkpoint
        if not (args.engine or checkpoint or draft or args.model):
            from ..commands.common import DEFAULT_ASSETS, default_pair_dirs
            pair = default_pair_dirs()
            if pair is None:
                raise SystemExit("error: give a model source: --engine DIR, --checkpoint DIR "
                                 f"--draft-checkpoint DIR, or --model PRESET --random-weights (the built-in "
                                 f"default pair is not in {DEFAULT_ASSETS})")
            checkpoint, draft = pair
            print(f"[dspark-trt] no model source given: the built-in default pair ({DEFAULT_ASSETS})")
        src = cls(engine=path(args.engine), checkpoint=path(checkpoint),
                  draft_checkpoint=path(draft), model=args.model or "",
                  random_weights=bool(getattr(args, "random_weights", False)),
                  dtype=args.dtype or "", device=args.device or "",
                  num_spec_tokens=args.num_spec_tokens or 0, max_batch_size=args.max_batch_size,
                  max_seq_len=args.max_seq_len, speculative=not getattr(args, "no_speculative", False),
                  tp_size=getattr(args, "tp_size", 1) or 1,
                  expert_parallel=bool(getattr(args, "expert_parallel", False)))
        return src.validate()

    def validate(self) -> "ModelSource":
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
    def from_parameters(cls, params: dict[str, str]) -> "ModelSource":
        """From config.pbtxt string parameters (unknown keys are ignored)."""
        kw = {}
        for f in fields(cls):
            if f.name in params:
                raw = params[f.name]
                kw[f.name] = (raw.lower() == "true" if f.type == "bool" else
                              int(raw) if f.type == "int" else raw)
        return cls(**kw)

    def load(self, device: str | None = None):
        """Build the ``LLM`` (``device`` overrides, e.g. ``cuda:1`` for a KIND_GPU instance)."""
        from ..commands.common import load_llm
        from ..runtime.llm import LLM
        if self.engine and not hasattr(LLM, "from_engine"):
            raise RuntimeError("this dspark_trt has no engine loader yet (LLM.from_engine); "
                               "serve --checkpoint/--draft-checkpoint or --model instead")
        device = device or self.device or None
        dtype = self.dtype or ("bf16" if device and device.startswith("cuda") else None)
        args = argparse.Namespace(engine=self.engine or None, checkpoint=self.checkpoint or None,
                                  draft_checkpoint=self.draft_checkpoint or None,
                                  model=self.model or None, dtype=dtype, device=device,
                                  num_spec_tokens=self.num_spec_tokens or None,
                                  max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                                  tp_size=self.tp_size, expert_parallel=self.expert_parallel)
        return load_llm(args)


def _str(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)
