"""``prepare_models``: a ``ModelSource`` -> target and draft modules ready to run or export.

One path for ``LLM.from_preset`` / ``LLM.from_checkpoints`` and the builder: load (checkpoints,
on the host under tensor parallelism) or build with random weights -> shard for this rank ->
move -> (builder: fuse projections) -> stack V4 experts -> the draft's vocabulary
(``src.draft_vocab``: its head over a frequency-ranked subset, ``models/draft_vocab.py``). The modules come back holding weights
and shapes only: N (``src.num_spec_tokens``), the Markov sampler mode and the TP world are run
settings the caller passes on (``LLM(num_spec_tokens=, markov_sampler=, tp=)``, the builder's
export wrappers).
"""
from __future__ import annotations

import torch

from ..config import ConfigError, ModelPair, get_preset
from ..config.source import ModelSource
from ..models import build_models
from ..models.fuse import fuse_projections_
from ..models.v4_moe import stack_experts_
from .fp8 import apply_quantization_, check_draft_quantization, check_quantization, quantize_draft_


def prepare_models(src: ModelSource, dtype: torch.dtype, device, tp=None, *, pair: ModelPair | None = None,
                   seed: int = 0, fuse: bool = False):
    """-> (pair, target, draft). ``src.checkpoint`` / ``src.draft_checkpoint``: loaded (``pair`` is
    read from them); else random weights (``seed``) for ``pair`` (default: the preset
    ``src.model``), initialised directly on ``device``. With ``tp`` (a ``parallel.TPInfo``) the
    models are sharded for its rank and only the shard moves to ``device``. ``src.quantization``:
    the target's weight format (``checkpoints.fp8``: fp8 projections native, quantised or
    dequantised); ``src.draft_quantization``: the draft's (``quantize_draft_``). ``fuse``: one GEMM
    for q/k/v and one for gate/up (the builder's)."""
    check_draft_quantization(src.draft_quantization, None, tp.world if tp else 1)   # before anything loads
    if src.checkpoint:
        from .loaders import load_pair
        pair, target, draft = load_pair(src.checkpoint, src.draft_checkpoint, dtype,
                                        "cpu" if tp else device,
                                        quantization=src.quantization)
    else:
        pair = pair or get_preset(src.model)
        check_quantization(src.quantization, pair.target.arch)
        target, draft = build_models(pair, dtype, device, seed)
        apply_quantization_(pair, target, dtype, src.quantization)
    if src.draft_quantization:
        check_draft_quantization(src.draft_quantization, pair.draft.arch, tp.world if tp else 1)
        quantize_draft_(draft, src.draft_quantization)
    if tp:
        from ..parallel import shard_pair_
        shard_pair_(pair, target, draft, tp.rank, tp.world, src.expert_parallel)
        target.to(device), draft.to(device)
    if fuse:
        fuse_projections_(target), fuse_projections_(draft)      # one GEMM for q/k/v and for gate/up
    stack_experts_(target), stack_experts_(draft)                # V4 MoE: grouped GEMMs of the chosen experts
    if src.draft_vocab:
        apply_draft_vocab_(draft, src.draft_vocab, tp)
    return pair, target, draft


def check_draft_vocab(path: str, tp_size: int = 1, vocab_size: int | None = None):
    """``--draft-vocab``'s token ids [Vs] after its checks: no tensor parallelism (the draft's head
    is vocabulary-parallel there) and the file (``vocab_size`` None: its own vocabulary, what can be
    checked before any weights load)."""
    from ..models.draft_vocab import read_draft_vocab
    if tp_size > 1:
        raise ConfigError(f"--draft-vocab {path}: not with tensor parallelism (--tp-size {tp_size}: the "
                          "draft's head is vocabulary-parallel there)")
    return read_draft_vocab(path, vocab_size)


def apply_draft_vocab_(draft, path: str, tp=None) -> None:
    """The draft's head and Markov tables over the tokens of the draft-vocabulary file ``path``."""
    from ..models.draft_vocab import restrict_draft_vocab_
    if draft is None:
        raise ConfigError(f"--draft-vocab {path}: there is no draft")
    restrict_draft_vocab_(draft, check_draft_vocab(path, tp.world if tp else 1, draft.config.backbone.vocab_size))
