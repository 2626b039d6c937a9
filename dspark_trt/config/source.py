"""``ModelSource``: which model to load and how, defined once.

Read by the CLI (``add_source_args`` builds the argparse options, ``from_args`` reads them back),
the builder (``builder.build.BuildOptions`` extends it with the build's own options), serving
(``serving.source.ServedModel`` extends it with config.pbtxt parameters) and the runtime
(``runtime.llm.LLM.from_source``; ``LLM.from_preset`` / ``from_checkpoints`` / ``from_engine``
take the same names as keyword arguments). None means "the default": the engine's own where an
engine fixes it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from .checks import ConfigError, read_json
from .dtypes import DTYPE_CHOICES

DEFAULT_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "default"
FALLBACK_PRESET = "qwen3-tiny-dspark"
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_SEQ_LEN = 2048                     # tokens per sequence of the default KV pool (a full
                                               # batch of them); the default max_seq_len is the
                                               # model's context, as far as that pool holds one
MARKOV_SAMPLERS = ("exact", "topk")            # the draft's block sampler (models.dspark_qwen3)
QUANTIZATIONS = ("auto", "fp8", "fp8-w8a8", "none")   # target weight format (checkpoints.prepare)
DRAFT_QUANTIZATIONS = ("none", "fp8")                  # draft weight format (checkpoints.fp8)
VERIFY_COST_MODELS = ("trimmed", "padded", "packed", "auto")   # scheduled rounds' verify (runtime.verify_scheduler)


def resolve_num_spec_tokens(requested: int | None, draft_cfg) -> int:
    """N, the drafts per round: ``requested`` (the runtime setting), else the draft's trained block
    size (its checkpoint config's ``block_size``, the published DSpark / DeepSpec name)."""
    if requested is not None and requested < 0:
        raise ConfigError(f"num_spec_tokens must be >= 1, got {requested}")
    return requested or draft_cfg.block_size


def source_context(src: "ModelSource") -> int | None:
    """The context length (config ``max_position_embeddings``) of what ``src`` names, read before
    any weights load: an upper bound of the default max_seq_len (None: an engine, or unknown)."""
    if src.engine:
        return None
    ckpt = src.checkpoint or (None if src.model else (default_pair_dirs() or (None,))[0])
    if ckpt is not None:
        path = Path(ckpt) / "config.json"
        return read_json(path).get("max_position_embeddings") if path.exists() else None
    from .presets import get_preset
    return getattr(get_preset(src.model or FALLBACK_PRESET).target, "max_position_embeddings", None)


def default_pair_dirs() -> tuple[Path, Path] | None:
    """(target, draft) checkpoint directories of the built-in default pair, if present."""
    t, d = DEFAULT_ASSETS / "target", DEFAULT_ASSETS / "draft"
    return (t, d) if (t / "config.json").exists() and (d / "config.json").exists() else None


@dataclass
class ModelSource:
    model: str | None = None                 # preset name (random weights unless checkpoints are given)
    checkpoint: str | None = None            # target HF checkpoint directory
    draft_checkpoint: str | None = None      # draft HF checkpoint directory
    engine: str | None = None                # engine directory built by `dspark-trt build`
    random_weights: bool = False             # a preset's dims with random weights (said explicitly)
    dtype: str | None = None                 # a DTYPES name or "auto" (= None, the default): the
                                             # checkpoint's torch_dtype (bf16 / fp16 run in fp32 on
                                             # a CPU), a preset's bf16 on cuda / fp32 on cpu, an
                                             # engine's own
    device: str | None = None                # cpu, cuda, cuda:N; None: cuda when available
    num_spec_tokens: int | None = None       # N drafts per round; None: the draft's block size
    markov_sampler: str | None = None        # MARKOV_SAMPLERS; None: exact (an engine's compiled in)
    draft_vocab: str | None = None           # a draft-vocabulary file (`dspark-trt draft-vocab`):
                                             # the draft's head over those tokens only
                                             # (models/draft_vocab.py; an engine's compiled in)
    kv_cache_dtype: str = "auto"             # KV_CACHE_DTYPES: "auto" (the model's dtype) or
                                             # "fp8_ds_mla" (DeepSeek-V4 latent rows in fp8)
    quantization: str | None = None          # QUANTIZATIONS; None / "auto": the checkpoint's or
                                             # preset's format (fp8 kept native); "fp8": target
                                             # projections in fp8 (quantised at load if stored
                                             # wider; DeepSeek-V4: routed experts in MXFP4);
                                             # "fp8-w8a8": "fp8" with activations quantised
                                             # per (token, 128 columns) in those GEMMs (W8A8);
                                             # "none": fp8 dequantised to --dtype at load
    draft_quantization: str | None = None    # DRAFT_QUANTIZATIONS; None / "none": the draft in
                                             # --dtype; "fp8": a Qwen3 draft's attention / MLP
                                             # projections quantised to fp8 at load (weight-only)
    verify_cost_model: str = "trimmed"       # VERIFY_COST_MODELS: how scheduled rounds verify
                                             # their admitted drafts (LLM's cost_model)
    tp_size: int = 1                         # tensor-parallel ranks (torchrun)
    expert_parallel: bool = False            # with tp_size > 1: MoE experts split by expert
    max_batch_size: int | None = None        # None: DEFAULT_MAX_BATCH_SIZE (an engine's own)
    max_seq_len: int | None = None           # prompt + new tokens; None: the model's context
                                             # (max_position_embeddings), capped to what the KV
                                             # pages hold for one sequence (an engine's own)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes):
        """The options ``add_source_args`` added (and any other field of ``cls`` found in ``args``)."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**kw, **changes})

    def source_fields(self) -> dict:
        """This object's ``ModelSource`` fields only (a subclass's own options left out)."""
        return {f.name: getattr(self, f.name) for f in fields(ModelSource)}


# ---- the CLI options: one flag per field -----------------------------------------------------

FLAGS = {
    "model": dict(help="preset name (random weights unless checkpoints are given)"),
    "checkpoint": dict(help="target HF checkpoint directory"),
    "draft_checkpoint": dict(help="draft HF checkpoint directory"),
    "engine": dict(help="engine directory built by `dspark-trt build`"),
    "random_weights": dict(action="store_true", help="random weights with the preset's dims"),
    "dtype": dict(choices=list(DTYPE_CHOICES),
                  help="auto (default): the checkpoint's torch_dtype (a bf16 / fp16 checkpoint runs "
                       "in fp32 on a CPU: bf16 GEMMs there are not batch-invariant), bf16 on CUDA / "
                       "fp32 on a CPU for random weights, an engine's own"),
    "device": dict(help="cpu or cuda (default: cuda when available)"),
    "num_spec_tokens": dict(type=int, help="N drafts per round (default: the draft's block size; "
                                           "an engine's is fixed)"),
    "markov_sampler": dict(choices=list(MARKOV_SAMPLERS),
                           help="draft block sampler: exact (default) or topk (fast, lossless); "
                                "engines have theirs compiled in"),
    "draft_vocab": dict(metavar="FILE",
                        help="a draft-vocabulary file (`dspark-trt draft-vocab`): the draft proposes "
                             "only its tokens and reads only their rows of the head (lossless; "
                             "acceptance drops where the target picks other tokens); engines have "
                             "theirs compiled in"),
    "kv_cache_dtype": dict(choices=["auto", "fp8_ds_mla"], default="auto",
                           help="auto (default): KV cache in --dtype; fp8_ds_mla: DeepSeek-V4 MLA "
                                "latent rows in fp8 (584 B a row at V4's dims, vLLM's layout; eager "
                                "modules only, not engines)"),
    "quantization": dict(choices=list(QUANTIZATIONS),
                         help="target weights: auto (default: as stored; an fp8 checkpoint / preset "
                              "stays fp8 in memory), fp8 (attention / MLP projections in fp8 e4m3 "
                              "with 128x128 block scales; DeepSeek-V4: routed experts in MXFP4), "
                              "fp8-w8a8 (fp8, and the activations into those projections quantised "
                              "per token and 128 columns to fp8 too: fp8 tensor-core GEMMs, the FP8 "
                              "checkpoints' activation_scheme 'dynamic'), none (dequantise to --dtype)"),
    "draft_quantization": dict(choices=list(DRAFT_QUANTIZATIONS),
                               help="draft weights: none (default: --dtype) or fp8 (a Qwen3 draft's "
                                    "attention / MLP projections quantised to fp8 e4m3 with 128x128 "
                                    "block scales at load, weight-only: half its layers' bytes; "
                                    "lossless, acceptance may change); engines have theirs compiled in"),
    "verify_cost_model": dict(choices=list(VERIFY_COST_MODELS), default="trimmed",
                              help="how rounds of verify_mode 'scheduled' verify what they admit: "
                                   "trimmed (default: one window for the batch, narrowed to the "
                                   "longest admitted prefix), packed (each row its own prefix, "
                                   "packed; Qwen3-family targets), auto (packed from 48 rows, "
                                   "trimmed below), padded (all N); see docs/confidence.md"),
    "tp_size": dict(type=int, default=1, help="tensor-parallel ranks; launch with `torchrun "
                                              "--nproc-per-node TP -m dspark_trt.cli`"),
    "expert_parallel": dict(action="store_true",
                            help="with --tp-size: split MoE experts across the ranks by expert "
                                 "(attention stays tensor-parallel); see docs/parallel.md"),
    "max_batch_size": dict(type=int, help=f"default: {DEFAULT_MAX_BATCH_SIZE} (an engine's own)"),
    "max_seq_len": dict(type=int, help="prompt + new tokens (default: the model's context, "
                                       "max_position_embeddings, as far as the KV cache holds one "
                                       "sequence: a shorter one is logged; an engine's own)"),
}


def add_source_args(p, names=tuple(FLAGS), **changes: dict) -> None:
    """Add ``--<name>`` for each ``ModelSource`` field in ``names`` to ``p`` (a parser or group);
    ``changes[name]`` updates that flag's argparse keywords (help, default, choices, ...)."""
    for name in names:
        p.add_argument(f"--{name.replace('_', '-')}", **{**FLAGS[name], **changes.get(name, {})})
