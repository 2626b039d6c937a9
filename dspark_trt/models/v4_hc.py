"""Manifold-constrained hyper-connections of DeepSeek-V4 (algorithm doc §8.2).

The residual stream is ``[..., hc, d]`` (hc = 4 streams). Around each sub-layer ``f``:
``y, post, comb = hc_pre(x)``; ``x = post * f(y) + comb^T x`` (``hc_post``). The mixing matrix
``comb`` is projected towards the doubly stochastic matrices by Sinkhorn iterations. The exit
``hc_head`` is a learned weighted sum of the streams without Sinkhorn.

Sinkhorn order (softmax over rows, +eps, one column normalisation, then (iters - 1) x row-then-
column) follows third-party descriptions of the reference, not the reference itself.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def _mix(x: Tensor, fn: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [..., hc, d] -> (flattened fp32+ stream xf [..., hc*d], mixes [..., fn_rows])."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.flatten(-2).to(acc)
    scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf, (xf @ fn.to(acc).T) * scale


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """logits [..., hc, hc] -> near doubly stochastic [..., hc, hc] (last step normalises columns)."""
    m = logits.softmax(-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """Parameters ``{prefix}_fn [(2 + hc) * hc, hc * d]``, ``_base [(2 + hc) * hc]``, ``_scale [3]``."""

    def __init__(self, hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        n = (2 + hc) * hc
        self.fn = nn.Parameter(torch.randn(n, hc * dim) * (hc * dim) ** -0.5)
        self.base = nn.Parameter(torch.randn(n) * 0.1)
        self.scale = nn.Parameter(torch.ones(3))

    def pre(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., hc, d] -> y [..., d], post [..., hc], comb [..., hc, hc] (comb[j, k]: j -> k)."""
        h = self.hc
        _, mix = _mix(x, self.fn, self.norm_eps)
        s, b = self.scale.to(mix.dtype), self.base.to(mix.dtype)
        pre = torch.sigmoid(mix[..., :h] * s[0] + b[:h]) + self.hc_eps
        post = 2 * torch.sigmoid(mix[..., h:2 * h] * s[1] + b[h:2 * h])
        comb_logits = (mix[..., 2 * h:] * s[2] + b[2 * h:]).unflatten(-1, (h, h))
        comb = sinkhorn(comb_logits, self.iters, self.hc_eps)
        y = (pre[..., None] * x.to(mix.dtype)).sum(-2)
        return y.to(x.dtype), post, comb

    @staticmethod
    def post(f_y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """out[k] = post[k] * f(y) + sum_j comb[j, k] * residual[j]  -> [..., hc, d]."""
        acc = post.dtype
        out = post[..., None] * f_y.to(acc)[..., None, :] + torch.einsum(
            "...jk,...jd->...kd", comb, residual.to(acc))
        return out.to(residual.dtype)


class HyperHead(nn.Module):
    """Exit of the streams: ``y = sum_c (sigmoid(mix_c * scale + base_c) + eps) x_c``."""

    def __init__(self, hc: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.randn(hc, hc * dim) * (hc * dim) ** -0.5)
        self.base = nn.Parameter(torch.zeros(hc))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        """x [..., hc, d] -> [..., d]."""
        _, mix = _mix(x, self.fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.scale.to(mix.dtype) + self.base.to(mix.dtype)) + self.hc_eps
        return (pre[..., None] * x.to(mix.dtype)).sum(-2).to(x.dtype)
