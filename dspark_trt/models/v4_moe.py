"""DeepSeek-V4 mixture of experts (algorithm doc §8.5).

Router: ``s = sqrt(softplus(x W_g^T))``; score-routed layers pick the top-k of ``s + bias`` (the
correction bias only selects); hash-routed layers (the first ``num_hash_layers``) take the experts
``tid2eid[token]``. Either way the weights are the raw ``s`` of the chosen experts, renormalised
and multiplied by ``routed_scaling_factor``. How the reference weights hash-routed experts is
third-party knowledge (doc §8.5 "uncertain"); this follows the same rule as score routing.
Experts are SwiGLU with ``silu(min(w1 x, L)) * clamp(w3 x, -L, L)`` (L = swiglu_limit) and the
routing weight applied before ``w2``; one always-on shared expert with the same clamp.

Compiled engines stack the routed experts after loading (``stack_experts_``: ``w13 [E, 2h, d]``,
``w2 [E, d, h]``, checkpoints keep the per-expert names) and run them through the grouped
``dspark::moe_experts`` op, which reads only the chosen experts, in eager, export and CUDA-graph
capture alike. Routed experts held in MXFP4 (``Mxfp4Linear``, ``--quantization fp8``) stack into
packed / E8M0 buffers of the same layout (``w13_packed [E, 2h, d/2]``, ``w13_scale [E, 2h, d/32]``,
``w2_packed [E, d, h/2]``, ``w2_scale [E, d, h/32]``) run by ``dspark::moe_experts_mxfp4``.
Unstacked modules keep the per-expert code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import plugins  # noqa: F401  (registers dspark::moe_experts)
from ..config import DeepSeekV4Config
from .mxfp4_linear import Mxfp4Linear


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden, bias=False)     # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)     # down
        self.w3 = nn.Linear(dim, hidden, bias=False)     # up

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x [M, d], weight [M] (routing weight, None for the shared expert) -> [M, d]."""
        acc = torch.promote_types(x.dtype, torch.float32)
        gate, up = self.w1(x).to(acc), self.w3(x).to(acc)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = h * weight.to(acc)[:, None]
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    def __init__(self, cfg: DeepSeekV4Config, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(E, cfg.hidden_size) * cfg.hidden_size ** -0.5)
        if hashed:
            self.register_buffer("tid2eid", torch.rand(cfg.vocab_size, E).argsort(-1)[:, :k].contiguous())
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(E))

    def forward(self, x: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x [M, d], token_ids [M] -> routing weights [M, k] (fp32+), expert ids [M, k]."""
        acc = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(acc) @ self.weight.to(acc).T
        f = self.cfg.scoring_func
        scores = (logits.softmax(-1) if f == "softmax" else logits.sigmoid() if f == "sigmoid"
                  else F.softplus(logits).sqrt())
        if self.hashed:
            idx = self.tid2eid[token_ids.clamp(min=0)]
        else:
            idx = (scores + self.bias.to(acc)).topk(self.cfg.num_experts_per_tok, -1).indices
        w = scores.gather(-1, idx)
        if f != "softmax" and self.cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * self.cfg.routed_scaling_factor, idx


class MoE(nn.Module):
    def __init__(self, cfg: DeepSeekV4Config, hashed: bool):
        super().__init__()
        d, h, lim = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed)
        self.experts = nn.ModuleList(Expert(d, h, lim) for _ in range(cfg.n_routed_experts))
        self.first_expert = 0          # global id of experts[0] (expert parallelism keeps a block)
        self.limit = lim
        self.register_parameter("w13", None)       # [E, 2h, d] gate then up rows, once stacked
        self.register_parameter("w2", None)        # [E, d, h]
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            self.register_buffer(name, None)        # MXFP4 experts, once stacked (module doc)
        self.shared_experts = Expert(d, h * cfg.n_shared_experts, lim) if cfg.n_shared_experts else None

    @torch.no_grad()
    def stack_experts_(self) -> None:
        """Move the routed experts' weights into ``w13``/``w2`` (MXFP4 experts: their packed bytes
        and scales into ``w13_packed``/``w13_scale``/``w2_packed``/``w2_scale``), one expert at a
        time, so the peak is one expert above the model, and drop ``experts``."""
        experts = list(self.experts)
        mx = isinstance(experts[0].w1, Mxfp4Linear)
        names = ({"weight": ("w13_packed", "w2_packed"), "weight_scale": ("w13_scale", "w2_scale")} if mx
                 else {"weight": ("w13", "w2")})
        keep = (lambda t: t) if mx else (lambda t: nn.Parameter(t, requires_grad=False))    # buffers / params
        out = {}
        for part in names:                          # [E, 2h, cols] gate then up rows; [E, d, cols]
            w1, w2 = getattr(experts[0].w1, part), getattr(experts[0].w2, part)
            out[part] = (w1.new_empty(len(experts), 2 * w1.shape[0], w1.shape[1]), w2.new_empty(len(experts), *w2.shape))
        for j, e in enumerate(experts):
            for part, (w13, w2) in out.items():
                h = w13.shape[1] // 2
                w13[j, :h], w13[j, h:], w2[j] = getattr(e.w1, part), getattr(e.w3, part), getattr(e.w2, part)
            e.w1 = e.w2 = e.w3 = None
        for part, (n13, n2) in names.items():
            setattr(self, n13, keep(out[part][0]))
            setattr(self, n2, keep(out[part][1]))
        self.experts = nn.ModuleList()

    @property
    def stacked(self) -> bool:
        return self.w13 is not None or self.w13_packed is not None

    def forward(self, x: Tensor, token_ids: Tensor) -> Tensor:
        """x [..., d], token_ids [...] -> [..., d]."""
        shape = x.shape
        x, token_ids = x.reshape(-1, shape[-1]), token_ids.reshape(-1)
        w, idx = self.gate(x, token_ids)                                    # [M, k]
        if self.w13 is not None:                                            # stacked: chosen experts only
            y = torch.ops.dspark.moe_experts(x, idx, w, self.w13, self.w2, self.first_expert, self.limit)
        elif self.w13_packed is not None:                                   # the same, MXFP4 experts
            y = torch.ops.dspark.moe_experts_mxfp4(x, idx, w, self.w13_packed, self.w13_scale, self.w2_packed,
                                                   self.w2_scale, self.first_expert, self.limit)
        else:
            y = self._experts_unstacked(x, w, idx)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)

    def _experts_unstacked(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        y = torch.zeros_like(x)
        if (torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            # Static shapes for export / graph capture: every expert over every token, weighted by
            # its routing weight (0 when not chosen). Exact, but reads every expert's weights.
            dense = torch.zeros(x.shape[0], self.gate.cfg.n_routed_experts, dtype=w.dtype, device=x.device)
            dense = dense.scatter(1, idx, w)                                # [M, E] global ids
            for j, expert in enumerate(self.experts):
                y = y + expert(x, dense[:, self.first_expert + j])
        else:
            lo, hi = self.first_expert, self.first_expert + len(self.experts)
            for e in idx.unique().tolist():                                 # eager: chosen experts only
                if lo <= e < hi:
                    rows, slot = (idx == e).nonzero(as_tuple=True)
                    y.index_add_(0, rows, self.experts[e - lo](x[rows], w[rows, slot]))
        return y


def stack_experts_(module: nn.Module) -> int:
    """Stack the routed experts of every unstacked ``MoE`` inside ``module`` (after loading and
    after tensor / expert-parallel sharding); returns how many were stacked."""
    moes = [m for m in module.modules() if isinstance(m, MoE) and not m.stacked and len(m.experts)]
    for m in moes:
        m.stack_experts_()
    return len(moes)
