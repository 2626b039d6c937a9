"""Building blocks shared by the networks: RMSNorm, neox RoPE, SwiGLU MLP, a paged KV cache."""
from __future__ import annotations

import torch
from torch import Tensor, nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


_ROPE_FREQS: dict = {}       # (head_dim, theta, device) -> [head_dim] float64 (``rope_freqs``)


def rope_freqs(head_dim: int, theta: float, device) -> Tensor:
    """[head_dim] float64: the neox inverse frequencies, the half repeated. Kept per device after
    the first call outside graph capture and tracing (five launches a step at decode sizes, where
    each costs about as much as a kernel of work)."""
    key = (head_dim, float(theta), torch.device(device))
    tracing = torch.compiler.is_compiling()         # (export, dynamo: computed in the graph, as before)
    if not tracing and (freqs := _ROPE_FREQS.get(key)) is not None:
        return freqs
    with torch.inference_mode(False):
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
        freqs = torch.cat([inv, inv])
    if not (tracing or (key[2].type == "cuda" and torch.cuda.is_current_stream_capturing())):
        _ROPE_FREQS[key] = freqs
    return freqs


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] (negative = inert, treated as 0) -> cos, sin [B, T, 1, head_dim] (any
    rank: [..., 1, head_dim])."""
    ang = positions.clamp(min=0)[..., None, None] * rope_freqs(head_dim, theta, positions.device)  # float64
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox (rotate-half) RoPE on x [B, T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class SwiGLU(nn.Module):
    row_kernels = False     # silu(gate) * up in one launch (``qwen3.use_row_kernels_``)

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up_proj = None                  # set by models.fuse.fuse_projections_

    def forward(self, x: Tensor) -> Tensor:
        if self.row_kernels:
            from ..plugins.kernels.norm_act import silu_mul
            return self.down_proj(silu_mul(self.gate_up_proj.rows(x)))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def make_paged_kv_cache(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype, device) -> dict[str, list[Tensor]]:
    """Per-layer K and V caches [num_pages + 1, page_size, Hkv, D]; the last page is the pad page."""
    shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
    return {"k": [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            "v": [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]}
