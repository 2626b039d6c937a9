"""The three compiled networks as export-ready modules with fixed signatures and dynamic dims.

Each wrapper's ``forward`` takes plain tensors; KV caches come as one flat list (``caches``), in
the pytree order of the model's ``make_cache`` dict, and are written in place by the dspark ops.

* ``target``        (tokens [B,T], positions [B,T], block_table [B,P], caches) -> logits [B,T,V], taps [B,T,m*d]
  One network serves target_prefill (T = prompt length) and target_verify (T = N+1): T is a
  dynamic dim, so the weights are compiled once and the runtime captures graphs per (B, T) bucket.
* ``draft_context`` (taps [B,T,m*d], positions [B,T], block_table [B,P], caches) -> ()
* ``draft_block``   (anchor [B], start [B], block_table [B,P], temperature [B], seed [B], caches)
  -> drafts [B,N] i64, z [B,N,V] f32   (block forward + Markov sampler)
  [+ confidence_logits [B,N] f32 when the draft has a confidence head: paper eq. 7, from the same
  forward, for the ``threshold`` / ``scheduled`` verify modes]

The verifier (``dspark::rejection_sample``) has no weights; the runtime calls the op directly.
Works for any target/draft pair that implements the networks interface (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.export import Dim
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..engine.caches import allocate_caches, cache_layout, cache_spec
from ..plugins.registry import OPS

NETWORKS = ("target", "draft_context", "draft_block")
SAMPLE_BATCH, SAMPLE_TOKENS = 2, 3          # sample sizes > 1 so export does not specialise them


# ---- the networks ------------------------------------------------------------------------------

class TargetNetwork(nn.Module):
    def __init__(self, target: nn.Module, spec):
        super().__init__()
        self.target, self.spec = target, spec

    def forward(self, tokens: Tensor, positions: Tensor, block_table: Tensor, caches: list[Tensor]):
        return self.target(tokens, positions, block_table, pytree.tree_unflatten(caches, self.spec))


class DraftContextNetwork(nn.Module):
    def __init__(self, draft: nn.Module, spec):
        super().__init__()
        self.draft, self.spec = draft, spec

    def forward(self, taps: Tensor, positions: Tensor, block_table: Tensor, caches: list[Tensor]):
        self.draft.context(taps, positions, block_table, pytree.tree_unflatten(caches, self.spec))
        return ()


class DraftBlockNetwork(nn.Module):
    """The draft block with its run settings compiled in: N and the Markov sampler mode. A draft
    with a confidence head also returns its confidence logits (one [B, N, d + r] x [d + r] product;
    fixed rounds ignore them)."""

    def __init__(self, draft: nn.Module, spec, num_spec_tokens: int, markov_sampler: str = "exact"):
        super().__init__()
        self.draft, self.spec = draft, spec
        self.num_spec_tokens, self.markov_sampler = num_spec_tokens, markov_sampler
        self.with_confidence = getattr(draft, "confidence_head", None) is not None

    @property
    def output_names(self) -> list[str]:
        return ["drafts", "draft_logits"] + (["confidence_logits"] if self.with_confidence else [])

    def forward(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                seed: Tensor, caches: list[Tensor]):
        return self.draft(anchor, start, block_table, temperature, seed,
                          pytree.tree_unflatten(caches, self.spec), with_confidence=self.with_confidence,
                          sampler=self.markov_sampler, num_spec_tokens=self.num_spec_tokens)


@dataclass
class BuildShapes:
    """The ranges the engine is built for (dynamic dims and their bounds)."""

    max_batch_size: int
    max_seq_len: int
    num_spec_tokens: int
    page_size: int

    @property
    def max_pages_per_seq(self) -> int:
        return -(-(self.max_seq_len + self.num_spec_tokens + 1) // self.page_size)

    def num_pages(self, max_batch_size: int | None = None) -> int:
        """Cache pages for a full batch of max-length sequences (the runtime default)."""
        return (max_batch_size or self.max_batch_size) * self.max_pages_per_seq


@dataclass
class ExportSpec:
    """One network ready for ``torch.export``: module, sample args, dynamic shapes, I/O names."""

    name: str
    module: nn.Module
    args: tuple
    dynamic_shapes: dict
    input_names: list[str]
    output_names: list[str]
    cache_group: str                    # "target" or "draft": which caches it takes


def network_specs(target: nn.Module, draft: nn.Module, shapes: BuildShapes, dtype: torch.dtype,
                  device, markov_sampler: str = "exact") -> list[ExportSpec]:
    """Wrap target and draft into the three networks with sample inputs on ``device``; N
    (``shapes.num_spec_tokens``) and ``markov_sampler`` are compiled into ``draft_block``."""
    B, T, N = SAMPLE_BATCH, SAMPLE_TOKENS, shapes.num_spec_tokens
    P = max(2, -(-(T + N + 1) // shapes.page_size))
    batch = Dim("batch", min=1, max=shapes.max_batch_size)
    tokens = Dim("tokens", min=1, max=shapes.max_seq_len)
    pages = Dim("pages_per_seq", min=1, max=max(2, shapes.max_pages_per_seq))
    num_pages = Dim("num_pages", min=1, max=1 << 24)

    def caches(module):
        layout = cache_layout(module, shapes.page_size, dtype)
        dyn = [{i: num_pages * c + b if c != 1 or b != 0 else num_pages
                for i, (b, c) in enumerate(zip(d["base"], d["pages_coef"])) if c}
               for d in layout]
        return allocate_caches(layout, B * P, device), dyn

    i64 = dict(dtype=torch.int64, device=device)
    table = torch.arange(B * P, **i64).view(B, P)
    positions = torch.arange(T, **i64).repeat(B, 1)
    tcache, tdyn = caches(target)
    dcache, ddyn = caches(draft)
    with torch.no_grad():
        _, taps = target(torch.zeros(B, T, **i64), positions, table,
                         pytree.tree_unflatten([c.clone() for c in tcache], cache_spec(target, shapes.page_size, dtype)))
    bt, bp, bb = {0: batch, 1: tokens}, {0: batch, 1: pages}, {0: batch}
    block = DraftBlockNetwork(draft, cache_spec(draft, shapes.page_size, dtype), N, markov_sampler)
    return [
        ExportSpec("target", TargetNetwork(target, cache_spec(target, shapes.page_size, dtype)),
                   (torch.ones(B, T, **i64), positions, table, tcache),
                   {"tokens": bt, "positions": bt, "block_table": bp, "caches": tdyn},
                   ["tokens", "positions", "block_table"], ["logits", "taps"], "target"),
        ExportSpec("draft_context", DraftContextNetwork(draft, cache_spec(draft, shapes.page_size, dtype)),
                   (taps.to(dtype), positions, table, dcache),
                   {"taps": bt, "positions": bt, "block_table": bp, "caches": ddyn},
                   ["taps", "positions", "block_table"], [], "draft"),
        ExportSpec("draft_block", block,
                   (torch.ones(B, **i64), torch.tensor([0, 1], **i64), table,
                    torch.tensor([0.0, 1.0], dtype=torch.float32, device=device), torch.arange(B, **i64),
                    dcache),
                   {"anchor": bb, "start": bb, "block_table": bp, "temperature": bb, "seed": bb,
                    "caches": ddyn},
                   ["anchor", "start", "block_table", "temperature", "seed"], block.output_names, "draft"),
    ]


# ---- dspark ops: reference inlining ------------------------------------------------------------

def reference_impls() -> dict[str, object]:
    """``dspark::<op>`` name -> its plain PyTorch reference, for every op of the plugins' registry."""
    return {op.qualname: op.reference for op in OPS.values()}


def op_name(func) -> str | None:
    """'dspark::x' for torch.ops.dspark.x (packet or overload), else None."""
    name = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", None)
    return name if isinstance(name, str) and name.startswith("dspark::") else None


def triton_ops() -> set[str]:
    """dspark ops registered with ``torch.library.triton_op`` (inductor compiles their kernels)."""
    from torch._library.triton import triton_ops_to_kernels
    return {n for n in triton_ops_to_kernels if n.startswith("dspark::")}


class ReferenceOps(TorchFunctionMode):
    """While active, calls to dspark ops (except ``keep``) run their PyTorch reference instead, so
    export traces plain aten ops that any inductor backend (CPU included) can compile. Records
    which dspark ops the traced code called (``kept``: as ops, ``inlined``: as references)."""

    def __init__(self, keep: set[str] = frozenset()):
        super().__init__()
        self.refs = {n: f for n, f in reference_impls().items() if n not in keep}
        self.kept: set[str] = set()
        self.inlined: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        ref = self.refs.get(name)
        if name:
            (self.inlined if ref else self.kept).add(name)
        return (ref or func)(*args, **(kwargs or {}))


# Triton ops whose launchers choose their launch parameters without specialising on dynamic
# shapes (the Markov samplers fall back to fixed row tiles and the per-step schedule when traced;
# moe_experts, moe_experts_mxfp4 and fp8_linear size their grids from M symbolically, fp8_linear
# choosing its body by M inside one kernel); the others are compiled from their references,
# for the reason given here. Both come from the plugins' registry (``export_safe``,
# ``reference_reason``).
EXPORT_SAFE_KERNELS = {op.qualname for op in OPS.values() if op.export_safe}
REFERENCE_REASONS = {op.qualname: op.reference_reason for op in OPS.values() if op.reference_reason}
CPU_REASON = "CPU build: inductor compiles no Triton kernels on CPU"


def ops_to_inline(device: torch.device) -> set[str]:
    """CPU: every dspark op (inductor cannot compile Triton there). GPU: ops without an
    export-safe Triton kernel."""
    all_ops = set(reference_impls())
    return all_ops if device.type == "cpu" else all_ops - (triton_ops() & EXPORT_SAFE_KERNELS)


def reference_reason(op: str, device: torch.device) -> str:
    if device.type == "cpu":
        return CPU_REASON
    if op not in triton_ops():
        return "no Triton kernel registered (Triton not installed?)"
    return REFERENCE_REASONS.get(op, "its launcher specialises on dynamic shapes")


def export_network(spec: ExportSpec, inline: set[str]) -> tuple[torch.export.ExportedProgram, dict]:
    """torch.export with the dspark ops in ``inline`` replaced by their references. Returns the
    program and ``{op: "kernel" | "reference"}`` for every dspark op the network calls."""
    keep = set(reference_impls()) - set(inline)
    mode = ReferenceOps(keep)
    with torch.no_grad(), mode:
        ep = torch.export.export(spec.module, spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
    return ep, {**{n: "kernel" for n in sorted(mode.kept)}, **{n: "reference" for n in sorted(mode.inlined)}}
