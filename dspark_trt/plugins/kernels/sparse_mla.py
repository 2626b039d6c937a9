"""Triton kernel of ``dspark::sparse_mla_attention``: gathered MQA over a shared latent KV.

One program per (query token, tile of BLOCK_H heads). The token's index list is walked in BLOCK_N
entries: gather ``kv[idx]`` [BLOCK_N, D] once for all heads of the tile, ``s = q · kv`` (fp32
accumulation), online softmax whose running max starts at the head's sink (so the sink enters the
denominator as ``e^{sink - m}``), ``o += p · kv[:, :dv]``. Entries with ``idx < 0`` are skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, pow2


@triton.jit
def sparse_mla_attention_kernel(q, kv, indices, attn_sink, out, scale, W, H,
                                D: tl.constexpr, DV: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q_off = (t.to(tl.int64) * H + h) * D
    qt = tl.load(q + q_off[:, None] + d[None, :], mask=hmask[:, None], other=0.0)      # [BLOCK_H, D]
    sink = tl.load(attn_sink + h, mask=hmask, other=0.0).to(tl.float32)
    m_i = sink                                                                         # running max
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for n0 in range(0, W, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(indices + t.to(tl.int64) * W + j, mask=j < W, other=-1)
        valid = idx >= 0
        row = tl.maximum(idx, 0).to(tl.int64) * D
        g = tl.load(kv + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)    # [BLOCK_N, D]
        s = tl.dot(qt, tl.trans(g), input_precision="ieee") * scale                     # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        gv = tl.load(kv + row[:, None] + dv[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(gv.dtype), gv, input_precision="ieee")
        m_i = m_new
    o = acc / (l_i + tl.exp(sink - m_i))[:, None]
    tl.store(out + (t.to(tl.int64) * H + h)[:, None] * DV + dv[None, :], o.to(out.dtype.element_ty),
             mask=hmask[:, None])


def sparse_mla_attention_triton(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor,
                                scale: float, dv: int) -> Tensor:
    T, H, D = q.shape
    if D != pow2(D) or dv != pow2(dv) or dv > D:
        raise ValueError(f"sparse_mla_attention kernel needs power-of-two D >= dv, got D={D}, dv={dv}")
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    if T == 0 or H == 0:
        return out
    block_h = 16
    launcher(sparse_mla_attention_kernel)[(T, triton.cdiv(H, block_h))](
        q.contiguous(), kv.contiguous(), indices.contiguous(), attn_sink.contiguous(), out,
        float(scale), indices.shape[1], H, D=D, DV=dv, BLOCK_H=block_h,
        BLOCK_N=32 if D >= 256 else 64, num_warps=8 if D >= 256 else 4)
    return out
