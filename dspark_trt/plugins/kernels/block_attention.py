"""Triton kernel of ``dspark::block_attention``: flash-style GQA over a paged KV cache.

One program per (row b, KV head, tile of BLOCK_T queries): its BLOCK_T * G query heads (G = H / Hkv)
share every K/V tile they load. Keys are visited in BLOCK_N tiles up to the tile's largest
``kv_limit``; each query masks keys beyond its own limit. Online softmax in fp32, fp32
accumulation; inert queries write zeros.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
import torch

from .common import launcher, pow2


@triton.jit
def block_attention_kernel(q, k_cache, v_cache, block_table, positions, kv_limit, out, scale,
                           T, P, PAGE_SIZE, PAD_PAGE,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    G: tl.constexpr = H // HKV
    BLOCK_M: tl.constexpr = BLOCK_T * G
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T

    rows = tl.arange(0, BLOCK_M)
    t = t0 + rows // G                                       # query token of each row
    h = kvh * G + rows % G                                   # query head of each row
    tmask = t < T
    first_page = tl.load(block_table + b * P)
    pos = tl.load(positions + b * T + t, mask=tmask, other=-1)
    lim = tl.load(kv_limit + b * T + t, mask=tmask, other=-1)
    lim = tl.where(pos >= 0, lim, -1)                        # [BLOCK_M], -1 = inert
    lim = tl.where(first_page >= 0, lim, -1)
    lim = tl.minimum(lim, P * PAGE_SIZE - 1)

    d = tl.arange(0, D)
    q_off = ((b * T + t).to(tl.int64) * H + h) * D
    qt = tl.load(q + q_off[:, None] + d[None, :], mask=tmask[:, None], other=0.0)   # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.max(lim) + 1
    for n0 in range(0, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        page = tl.load(block_table + b * P + kpos // PAGE_SIZE, mask=kmask, other=0)
        page = tl.where(page >= 0, page, PAD_PAGE)
        kv_off = ((page * PAGE_SIZE + kpos % PAGE_SIZE).to(tl.int64) * HKV + kvh) * D
        kt = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale                 # [BLOCK_M, BLOCK_N]
        s = tl.where(kpos[None, :] <= lim[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    o = tl.where((lim >= 0)[:, None], o, 0.0)
    tl.store(out + q_off[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=tmask[:, None])


def block_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                           positions: Tensor, kv_limit: Tensor, scale: float) -> Tensor:
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv if Hkv else 0
    if G == 0 or H % Hkv or G != pow2(G) or D != pow2(D):
        raise ValueError(f"block_attention kernel needs H / Hkv and the head dim to be powers of two, "
                         f"got H={H}, Hkv={Hkv}, D={D}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_t = max(pow2(16 // G), min(pow2(T), max(1, 64 // G)))   # BLOCK_T * G in [16, 64] (>= 16 for tl.dot)
    grid = (B, Hkv, triton.cdiv(T, block_t))
    launcher(block_attention_kernel)[grid](
        q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_table.contiguous(),
        positions.contiguous(), kv_limit.contiguous(), out, float(scale),
        T, block_table.shape[1], k_cache.shape[1], k_cache.shape[0] - 1,
        H=H, HKV=Hkv, D=D, BLOCK_T=block_t, BLOCK_N=64, num_warps=4)
    return out
