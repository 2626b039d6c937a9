"""Opt-in ``torch.compile`` of ``LLM``'s eager step modules (``LLM(..., compile=True)``).

Regional compilation: the two phases of every Qwen3 decoder layer around its attention
(``Qwen3DecoderLayer.attention_input`` / ``attention_output``; target and draft share the class, so
one compiled graph per shape class serves all 36 + 5 layers: compile time is that of one layer, not
of the model), the norms outside the layers, and the draft's context injection (5 small k/v
projections). Inside a phase inductor fuses what eager runs as separate kernels, each a round trip
to HBM: the previous layer's residual add with the input RMSNorm (``run_layers`` defers it), q/k
norm + RoPE, the KV-cache write, SiLU * up, the attention's residual add with the post-attention
norm. The projections stay cuBLAS GEMMs, as in an AOTI engine.

Between the phases the block attention runs eagerly (``dspark::block_attention``): inductor's
decomposition of the user-Triton-kernel wrapper asserted on the block-attention kernel at head dim
16 on the H200 (torch 2.11, ``benchmarks/results/gpu-smoke-a8f3096.log.gz``). Splitting the layer by hand, not by a
graph break inside it, keeps each phase one graph: a break nested in the layer's call made dynamo
compile the input norm, the projections and the cache write as separate graphs. The KV-cache write
(``Qwen3Attention.write_cache``) becomes its torch form (``kv_cache_write_ref``: an indexed store,
inert rows routed to the pad page), which inductor fuses into the kernel that produces the rows and
stores in place into the static cache: one launch per layer fewer than ``dspark::kv_cache_write``.

Shapes are dynamic (batch, tokens and pages per row symbolic; sizes 1 get their own graph), so the
prefill lengths and the CUDA-graph buckets share a handful of graphs; the KV caches are marked
static (``mark_caches_static``: their sizes never change, and symbolic ones would only add guards). Compilation happens on the first call of a
shape, which for decode steps is the eager warm-up before each CUDA-graph capture; the replays run
the compiled kernels with no Python. On CPU inductor compiles C++ (slow the first time: about a
minute for a tiny model on two cores); ``compile="aot_eager"`` traces without code generation (what
the CPU tests use).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..config import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "aot_eager", "eager")
RECOMPILE_LIMIT = 64        # graphs per compiled code object (shape classes x target / draft callers)


def compile_backend(compile: bool | str | None) -> str | None:
    """``compile`` as given to ``LLM`` -> the torch.compile backend (None: not compiled)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "inductor"
    if compile not in BACKENDS:
        raise ConfigError(f"compile={compile!r}: choose True / 'inductor', 'aot_eager' or 'eager'")
    return compile


def compile_regions_(module: nn.Module, backend: str = "inductor") -> int:
    """Compile ``module``'s repeated regions in place (see the module docstring); returns how many
    modules / methods were wrapped. Only Qwen3 targets and their DSpark drafts are supported."""
    from ..models.dspark_qwen3 import DSparkQwen3Draft
    from ..models.layers import RMSNorm
    from ..models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
    from ..plugins.kv_cache import kv_cache_write_ref
    if not isinstance(module, (Qwen3ForCausalLM, DSparkQwen3Draft)):
        raise ConfigError(f"compile=True supports Qwen3 targets and DSpark-Qwen3 drafts, not "
                          f"{type(module).__name__}; run it without compile")
    _raise_recompile_limit()
    n = 0
    layers = [m for m in module.modules() if isinstance(m, Qwen3DecoderLayer)]
    inside = {id(x) for layer in layers for x in layer.modules()}
    for layer in layers:                           # the bound methods, shadowed on the instance
        layer.self_attn.write_cache = kv_cache_write_ref
        layer.attention_input = torch.compile(layer.attention_input, backend=backend, dynamic=True)
        layer.attention_output = torch.compile(layer.attention_output, backend=backend, dynamic=True)
        n += 2
    for m in module.modules():
        if isinstance(m, RMSNorm) and id(m) not in inside:
            m.compile(backend=backend, dynamic=True)
            n += 1
    if isinstance(module, DSparkQwen3Draft):     # the bound method, shadowed on the instance
        module.context = torch.compile(module.context, backend=backend, dynamic=True)
        n += 1
    return n


def mark_caches_static(*caches) -> None:
    """Mark every tensor of the cache dicts / lists given static for dynamo (all dims)."""
    for c in caches:
        for t in (c.values() if isinstance(c, dict) else [c]):
            for x in (t if isinstance(t, (list, tuple)) else [t]):
                if isinstance(x, torch.Tensor):
                    torch._dynamo.mark_static(x)


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < RECOMPILE_LIMIT:
        log.info("torch._dynamo.config.%s raised to %d for the compiled step regions", name, RECOMPILE_LIMIT)
        setattr(cfg, name, RECOMPILE_LIMIT)
