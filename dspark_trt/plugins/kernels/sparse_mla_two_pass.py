"""Two-pass route of ``dspark::sparse_mla_attention``: scores and values in separate launches.

The fused kernel (``sparse_mla.py``) holds a program's whole output tile, BLOCK_H heads x 512
value dims in fp32, beside its query tile and the scores: 32 heads per program, 32-row
``mma.sync`` MMAs and two programs per SM (the 64-row tiles Hopper's ``wgmma`` needs spill or
run one program per SM). Split in two, each pass is a plain GEMM loop over the token's index list:

* ``sparse_mla_scores_kernel``, grid (T, cdiv(H, BLOCK_H)): ``s = q · kv[idx]`` per BLOCK_N
  entries, the online softmax whose running max starts at the head's sink; it writes each
  tile's ``p = e^{s - m}`` in kv's dtype (the fused kernel's rounding of p), the tile's
  rescale ``alpha = e^{m_prev - m}`` and, per row, the denominator ``l + e^{sink - m}``;
* ``sparse_mla_values_kernel``, grid (T, cdiv(H, BLOCK_HV) * DV / BLOCK_DV): ``acc = acc * alpha +
  p · kv[idx, dv0:dv0 + BLOCK_DV]`` over the same tiles, then ``acc / den``. No scores here, so
  its tile can be BLOCK_HV heads x BLOCK_DV dims of any split (the scores are not recomputed).

Both walk the list up to its last valid entry (``sparse_mla.list_end``); tiles hold entries
[n0, n0 + BLOCK_N) in both passes, so BLOCK_N is shared. Workspace (sized from shapes): p
[T * H, W] in kv's dtype, alpha [T * H, cdiv(W, BLOCK_N)] and den [T * H] in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, pow2
from .sparse_mla import MAX_SCAN, list_end

# scores: BLOCK_H heads x BLOCK_N entries per tile; values: BLOCK_HV heads x BLOCK_DV dims
TWO_PASS_DEFAULTS = dict(block_n=64, scores=dict(block_h=64, num_warps=4, num_stages=2),
                         values=dict(block_h=64, block_dv=512, num_warps=8, num_stages=2))


@triton.jit
def _gather(kv, idx, cols, D: tl.constexpr):
    """kv[idx, cols] [BLOCK_N, len(cols)]; rows with idx < 0 are 0."""
    row = tl.maximum(idx, 0).to(tl.int64) * D
    return tl.load(kv + row[:, None] + cols[None, :], mask=(idx >= 0)[:, None], other=0.0)


@triton.jit
def sparse_mla_scores_kernel(q, kv, indices, attn_sink, p_ws, alpha_ws, den_ws, scale, W, H, C,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_SCAN: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H)). q [T, H, D] -> p_ws [T*H, W] (tiles up to the list's end),
    alpha_ws [T*H, C] (C = cdiv(W, BLOCK_N)), den_ws [T*H]. The next tile's indices are loaded one
    iteration ahead (the fused kernel's PREFETCH)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    qrow = t.to(tl.int64) * H + h                                                   # [BLOCK_H]
    scale = tl.cast(scale, tl.float32)        # AOTInductor passes Python floats as fp64 (Triton 3.6)
    d = tl.arange(0, D)
    qt = tl.load(q + qrow[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)   # [BLOCK_H, D]
    sink = tl.load(attn_sink + h, mask=hmask, other=0.0).to(tl.float32)
    m_i = sink
    l_i = tl.zeros_like(sink)
    ibase = indices + t.to(tl.int64) * W
    last = list_end(ibase, 0, W, BLOCK_SCAN)
    j = tl.arange(0, BLOCK_N)
    idx = tl.load(ibase + j, mask=j < W, other=-1)
    for n0 in range(0, last, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_next = j + BLOCK_N
        idx_next = tl.load(ibase + j_next, mask=j_next < W, other=-1)
        g = _gather(kv, idx, d, D)                                                  # [BLOCK_N, D]
        s = tl.dot(qt, tl.trans(g), input_precision="ieee") * scale                  # [BLOCK_H, BLOCK_N]
        s = tl.where((idx >= 0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        tl.store(p_ws + qrow[:, None] * W + j[None, :], p.to(p_ws.dtype.element_ty),
                 mask=hmask[:, None] & (j < W)[None, :])
        tl.store(alpha_ws + qrow * C + n0 // BLOCK_N, alpha, mask=hmask)
        m_i = m_new
        idx = idx_next
    tl.store(den_ws + qrow, l_i + tl.exp(sink - m_i), mask=hmask)


@triton.jit
def sparse_mla_values_kernel(p_ws, alpha_ws, den_ws, kv, indices, out, W, H, C, D: tl.constexpr,
                             DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_DV: tl.constexpr, BLOCK_SCAN: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H) * DV / BLOCK_DV): out [T, H, DV] from the scores pass's
    workspace and kv[idx, :DV]."""
    t = tl.program_id(0)
    h = (tl.program_id(1) // (DV // BLOCK_DV)) * BLOCK_H + tl.arange(0, BLOCK_H)
    dv = (tl.program_id(1) % (DV // BLOCK_DV)) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    hmask = h < H
    qrow = t.to(tl.int64) * H + h                                                   # [BLOCK_H]
    ibase = indices + t.to(tl.int64) * W
    last = list_end(ibase, 0, W, BLOCK_SCAN)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    j = tl.arange(0, BLOCK_N)
    idx = tl.load(ibase + j, mask=j < W, other=-1)
    for n0 in range(0, last, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_next = j + BLOCK_N
        idx_next = tl.load(ibase + j_next, mask=j_next < W, other=-1)
        p = tl.load(p_ws + qrow[:, None] * W + j[None, :], mask=hmask[:, None] & (j < W)[None, :], other=0.0)
        alpha = tl.load(alpha_ws + qrow * C + n0 // BLOCK_N, mask=hmask, other=1.0)
        v = _gather(kv, idx, dv, D)                                                 # [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        idx = idx_next
    den = tl.load(den_ws + qrow, mask=hmask, other=1.0)
    tl.store(out + qrow[:, None] * DV + dv[None, :], (acc / den[:, None]).to(out.dtype.element_ty),
             mask=hmask[:, None])


def two_pass_config(H: int, dv: int, overrides: dict | None = None) -> dict:
    """``TWO_PASS_DEFAULTS`` with ``overrides`` (the same nesting) merged in, tiles cut to the shape."""
    o = overrides or {}
    cfg = dict(block_n=o.get("block_n", TWO_PASS_DEFAULTS["block_n"]),
               scores={**TWO_PASS_DEFAULTS["scores"], **o.get("scores", {})},
               values={**TWO_PASS_DEFAULTS["values"], **o.get("values", {})})
    unknown = set(o) - {"block_n", "scores", "values"}
    if unknown:
        raise ValueError(f"sparse_mla_attention two_pass: unknown keys {sorted(unknown)}; "
                         f"expected block_n, scores, values")
    for part in ("scores", "values"):
        cfg[part]["block_h"] = min(cfg[part]["block_h"], pow2(H, 16))
    cfg["values"]["block_dv"] = min(cfg["values"]["block_dv"], dv)
    for name, v in (("block_n", cfg["block_n"]), ("values.block_dv", cfg["values"]["block_dv"])):
        if v != pow2(v):
            raise ValueError(f"sparse_mla_attention two_pass: {name} must be a power of two, got {v}")
    return cfg


def sparse_mla_two_pass(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, scale: float, dv: int,
                        out: Tensor, overrides: dict | None = None) -> Tensor:
    """Fills ``out`` [T, H, dv] (same contract as ``sparse_mla_attention_ref``) with the two passes;
    q, kv, indices, attn_sink contiguous, T and H > 0."""
    T, H, D = q.shape
    W = indices.shape[1]
    cfg = two_pass_config(H, dv, overrides)
    bn, sc, va = cfg["block_n"], cfg["scores"], cfg["values"]
    C = triton.cdiv(W, bn)
    scan = max(bn, min(pow2(W), MAX_SCAN))
    p_ws = torch.empty((T * H, W), dtype=kv.dtype, device=q.device)
    alpha_ws = torch.empty((T * H, C), dtype=torch.float32, device=q.device)
    den_ws = torch.empty((T * H,), dtype=torch.float32, device=q.device)
    launcher(sparse_mla_scores_kernel)[(T, triton.cdiv(H, sc["block_h"]))](
        q, kv, indices, attn_sink, p_ws, alpha_ws, den_ws, float(scale), W, H, C, D=D, BLOCK_H=sc["block_h"],
        BLOCK_N=bn, BLOCK_SCAN=scan, num_warps=sc["num_warps"], num_stages=sc["num_stages"])
    launcher(sparse_mla_values_kernel)[(T, triton.cdiv(H, va["block_h"]) * (dv // va["block_dv"]))](
        p_ws, alpha_ws, den_ws, kv, indices, out, W, H, C, D=D, DV=dv, BLOCK_H=va["block_h"], BLOCK_N=bn,
        BLOCK_DV=va["block_dv"], BLOCK_SCAN=scan, num_warps=va["num_warps"], num_stages=va["num_stages"])
    return out
