"""Triton kernels of ``dspark::sparse_mla_attention``: gathered MQA over a shared latent KV.

A program owns (query token t, tile of BLOCK_H heads, BLOCK_DV of the dv output dims, split s of
the token's index list). It walks its part of the list BLOCK_N entries at a time: gather
``kv[idx]`` [BLOCK_N, D] once for all heads of the tile, ``s = q · kv`` (fp32 accumulation),
online softmax whose running max starts at the head's sink (so the sink enters the denominator as
``e^{sink - m}``), ``o += p · kv[:, dv0:dv0 + BLOCK_DV]`` (the gathered tile itself when
BLOCK_DV = D). Entries with ``idx < 0`` are skipped, and the walk ends at the last valid entry (one
load scans the index list first), so the -1 padding of the 128-multiple width (120 of 256 entries
for a 128 window + 8-token block) costs no tensor-core work. With PREFETCH the indices of the next
tile are loaded one iteration ahead, so the gather's address does not wait on a load of the same
iteration and Triton's pipeliner overlaps it with the previous tile's products. Launch defaults
(``MLA_DEFAULTS``): 64 heads x all 512 value dims per program (whose scores are computed once), 64
index entries per step, 8 warps; 16 heads and 4 warps for few tokens.
Neighbouring tokens share most of their index lists (window + block), so the gathered rows mostly
come from L2.

* ``NUM_SPLITS == 1``: the program normalises and writes o (``sparse_mla_attention_kernel``, also
  the TensorRT AOT entry). ``group`` G > 1 (launch option, not the op's default): a program owns G
  consecutive tokens whose index lists are equal (the V4 draft block: every query of a row's block
  sees the same list, ``noncausal_swa_indices``), so its MMAs have G x BLOCK_H rows (Hopper's
  wgmma needs 64) and the list is scanned and gathered once per G tokens. The caller vouches that
  the lists are equal; the kernel reads the first token's.
* ``NUM_SPLITS > 1`` (few query tokens): each split writes (m, l, acc) to an fp32 workspace sized
  from shapes and ``sparse_mla_reduce_kernel`` merges them with the sink (no host sync).

Tried and removed (session 54, an H100, batch 64: the fused kernel with the default of then, 32
heads x 32 entries, 169.5 us): scores and values in two launches, a scores kernel writing each
tile's ``p`` (kv's dtype), its rescale and the row's denominator, then a values kernel
``acc = acc * alpha + p · kv[idx]``, 64-row ``wgmma`` tiles in both and no spill on sm_90 (so
neither holds the 64 x 512 fp32 output tile beside the scores): 174-208 us over seven tilings,
19-27 us at batch 1 against 15.8 (``tune-plugins-mla-NVIDIA-H100-80GB-HBM3-c293f47.json.gz``).
Also tried and removed (session 55, an H100): walking the entries past the last whole 64-entry tile
in 16- or 32-entry tiles (a V4 verify list's 136 entries as 64 + 64 + 16, a second loop after the
first): 178.4 / 180.3 us at batch 64 against 159.6 for whole tiles, 1.12x slower from 8 rows on,
equal below (``tune-plugins-NVIDIA_H100_80GB_HBM3-a5a8acf.json.gz``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import launcher, num_sms, pow2


@triton.jit
def _query_rows(t, h0, H, BLOCK_H: tl.constexpr, GROUP: tl.constexpr):
    """The program's query rows, GROUP tokens t .. t + GROUP - 1 x BLOCK_H heads h0 ..: (q row
    [GROUP * BLOCK_H] = token * H + head, head, head < H)."""
    r = tl.arange(0, GROUP * BLOCK_H)
    head = h0 + r % BLOCK_H
    return (t + r // BLOCK_H).to(tl.int64) * H + head, head, head < H


@triton.jit
def list_end(ibase, lo, hi, BLOCK_SCAN: tl.constexpr):
    """One past the last valid (>= 0) entry of the index list ``ibase[lo:hi]`` (lo if none), read
    BLOCK_SCAN entries per load: trailing -1 tiles are not walked."""
    last = tl.full([], 0, tl.int32) + lo
    for n0 in range(lo, hi, BLOCK_SCAN):
        j = n0 + tl.arange(0, BLOCK_SCAN)
        idx = tl.load(ibase + j, mask=j < hi, other=-1)
        last = tl.maximum(last, tl.max(tl.where(idx >= 0, j + 1, lo), 0))
    return last


@triton.jit
def _attend_entries(q, kv, indices, attn_sink, scale, t, qrow, h, hmask, dv0, lo, hi, W,
                    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SCAN: tl.constexpr, PREFETCH: tl.constexpr):
    """Online softmax of the query rows ``qrow`` (heads ``h``, masked by ``hmask``; M rows) over
    token t's index entries [lo, hi), values dims [dv0, dv0 + BLOCK_DV). Every row shares token
    t's list (rows of several tokens: the tokens' lists are equal, ``group``). Returns (m [M] >=
    sink, l [M], acc [M, BLOCK_DV] unnormalised, sink). The end of the walk comes from a scan of
    BLOCK_SCAN entries per load (one load for the whole list when BLOCK_SCAN >= hi - lo).
    PREFETCH: the indices of tile i+1 are loaded in iteration i, so the gather address is
    loop-carried and Triton's pipeliner can issue the gather num_stages - 1 tiles ahead."""
    scale = tl.cast(scale, tl.float32)        # AOTInductor passes Python floats as fp64 (Triton 3.6)
    d = tl.arange(0, D)
    qt = tl.load(q + qrow[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)    # [M, D]
    sink = tl.load(attn_sink + h, mask=hmask, other=0.0).to(tl.float32)
    m_i = sink                                                                         # running max
    l_i = tl.zeros_like(sink)
    acc = tl.zeros([qrow.shape[0], BLOCK_DV], tl.float32)
    ibase = indices + t.to(tl.int64) * W
    last = list_end(ibase, lo, hi, BLOCK_SCAN)
    if PREFETCH:                        # the first tile's indices; later ones one iteration ahead
        j = lo + tl.arange(0, BLOCK_N)
        idx = tl.load(ibase + j, mask=j < hi, other=-1)
    for n0 in range(lo, last, BLOCK_N):
        if PREFETCH:
            j_next = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            idx_next = tl.load(ibase + j_next, mask=j_next < hi, other=-1)
        else:
            j = n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(ibase + j, mask=j < hi, other=-1)
        valid = idx >= 0
        row = tl.maximum(idx, 0).to(tl.int64) * D
        g = tl.load(kv + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)    # [BLOCK_N, D]
        s = tl.dot(qt, tl.trans(g), input_precision="ieee") * scale                     # [M, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BLOCK_DV == D:
            gv = g
        else:
            dv = dv0 + tl.arange(0, BLOCK_DV)
            gv = tl.load(kv + row[:, None] + dv[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(gv.dtype), gv, input_precision="ieee")
        m_i = m_new
        if PREFETCH:
            idx = idx_next
    return m_i, l_i, acc, sink


@triton.jit
def sparse_mla_attention_kernel(q, kv, indices, attn_sink, out, scale, W, H,
                                D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SCAN: tl.constexpr = 32,
                                PREFETCH: tl.constexpr = False, GROUP: tl.constexpr = 1):
    """Grid (T / GROUP, cdiv(H, BLOCK_H) * DV / BLOCK_DV): the whole index list, normalised
    output; GROUP consecutive tokens (equal lists) per program."""
    t = tl.program_id(0) * GROUP
    h0 = (tl.program_id(1) // (DV // BLOCK_DV)) * BLOCK_H
    dv0 = (tl.program_id(1) % (DV // BLOCK_DV)) * BLOCK_DV
    qrow, h, hmask = _query_rows(t, h0, H, BLOCK_H, GROUP)
    m_i, l_i, acc, sink = _attend_entries(q, kv, indices, attn_sink, scale, t, qrow, h, hmask, dv0, 0, W, W,
                                          D, BLOCK_DV, BLOCK_N, BLOCK_SCAN, PREFETCH)
    o = acc / (l_i + tl.exp(sink - m_i))[:, None]
    dv = dv0 + tl.arange(0, BLOCK_DV)
    tl.store(out + qrow[:, None] * DV + dv[None, :], o.to(out.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def sparse_mla_split_kernel(q, kv, indices, attn_sink, part_ml, part_acc, scale, W, H, CHUNK,
                            D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SCAN: tl.constexpr,
                            PREFETCH: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H) * DV / BLOCK_DV, S): entries [s * CHUNK, (s+1) * CHUNK); partials
    part_ml [T, H, S, 2] (m, l; every dv tile computes the same, the first stores them) and
    part_acc [T, H, S, DV]."""
    t = tl.program_id(0)
    h0 = (tl.program_id(1) // (DV // BLOCK_DV)) * BLOCK_H
    dv0 = (tl.program_id(1) % (DV // BLOCK_DV)) * BLOCK_DV
    s = tl.program_id(2)
    qrow, h, hmask = _query_rows(t, h0, H, BLOCK_H, 1)
    lo = s * CHUNK
    m_i, l_i, acc, _ = _attend_entries(q, kv, indices, attn_sink, scale, t, qrow, h, hmask, dv0, lo,
                                       tl.minimum(lo + CHUNK, W), W, D, BLOCK_DV, BLOCK_N,
                                       BLOCK_SCAN, PREFETCH)
    slot = qrow * tl.num_programs(2) + s                                             # [BLOCK_H]
    if dv0 == 0:
        tl.store(part_ml + slot * 2, m_i, mask=hmask)
        tl.store(part_ml + slot * 2 + 1, l_i, mask=hmask)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    tl.store(part_acc + slot[:, None] * DV + dv[None, :], acc, mask=hmask[:, None])


@triton.jit
def sparse_mla_reduce_kernel(part_ml, part_acc, attn_sink, out, H, NUM_SPLITS, DV: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    """Grid (T * H,): o = sum_s acc_s e^{m_s - M} / (sum_s l_s e^{m_s - M} + e^{sink - M})."""
    row = tl.program_id(0).to(tl.int64)
    sink = tl.load(attn_sink + row % H).to(tl.float32)
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    m = tl.load(part_ml + (row * NUM_SPLITS + s) * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(part_ml + (row * NUM_SPLITS + s) * 2 + 1, mask=smask, other=0.0)
    dv = tl.arange(0, DV)
    acc = tl.load(part_acc + (row * NUM_SPLITS + s)[:, None] * DV + dv[None, :], mask=smask[:, None],
                  other=0.0)                                                        # [BLOCK_S, DV]
    mx = tl.max(m, 0)                                                               # >= sink (every m_s is)
    w = tl.exp(m - mx)
    o = tl.sum(acc * w[:, None], 0) / (tl.sum(l_s * w, 0) + tl.exp(sink - mx))
    tl.store(out + row * DV + dv, o.to(out.dtype.element_ty))


# Defaults (benchmarks/tune_plugins.py measures alternatives). block_h: heads per program (None: 64,
# or 16 where 64-head tiles would give fewer programs than half the SMs); block_dv: value dims per
# program (all 512: the scores are computed once); block_n: index entries per step; programs_per_sm:
# the index list is split while the grid has fewer programs than this many per SM (a quarter wave);
# num_warps (None): 8 for 64-row MMA tiles (block_h x group >= 64, Hopper's wgmma) and for split
# lists, 4 otherwise; prefetch: indices one tile ahead. H100, graph replays, batch rows of 8 tokens
# (tune-plugins-NVIDIA_H100_80GB_HBM3-9846ec5.json.gz; 1 / 2 / 4 / 8 / 16 / 32 / 64 rows):
#   64 heads x 64 entries, 8 warps (wgmma; 255 registers, 112 B of stack, 192 KiB of shared memory
#     on sm_90: one program per SM), whole lists   17.5 17.4 17.8 19.2 39.2 83.2 159.9 us
#   the same with the earlier split rule (split below one wave)   14.6 17.9 22.5 45.9 39.3 83.6 159.8
#   16 heads x 64 entries, 4 warps, whole lists   10.1 10.4 14.4 26.0 51.7 100.4 198.1
#   the earlier default, 32 heads x 32 entries, 4 warps (mma.sync), split below one wave
#                                                 14.7 19.5 29.8 22.0 42.0 86.0 168.3
# so the rule takes 16 heads up to 4 rows, 64 from 8, and splits no list of these shapes (it still
# splits where even 16-head tiles leave fewer than 33 programs: fewer than 5 tokens of 128 heads,
# not timed). Batch 64 in other calls: the default 163.2 against 169.6 for the earlier one
# (tune-plugins-NVIDIA_H100_80GB_HBM3-b8278b3.json.gz); H200, the earlier default 167 us
# (tune-plugins-NVIDIA_H200-26d611d.json.gz). Nsight Compute of the earlier default: 65,536
# local-memory spill requests, 6.5 cycles per issued instruction (ncu-mla-default-*-3f950c3.txt).
# Overrides keep the other defaults: 3 stages, or 256-dim value tiles, of 64-entry tiles need more
# than sm_90's 227 KiB of shared memory (Triton's OutOfResources), so such configs name block_n 32.
MLA_DEFAULTS = dict(block_h=None, block_dv=512, block_n=64, num_warps=None, num_stages=2, programs_per_sm=0.25,
                    prefetch=True, group=1)
WIDE_BLOCK_H, NARROW_BLOCK_H = 64, 16
MAX_SCAN = 512             # index entries per load of the end-of-list scan


def head_dv_tiles(H: int, dv: int, block_h: int, block_dv: int) -> int:
    """Programs per query token (or per group of G tokens): head tiles x value-dim tiles."""
    return triton.cdiv(H, block_h) * (dv // block_dv)


def narrow_token_limit(H: int, dv: int, device: torch.device, block_dv: int | None = None) -> int:
    """The most query tokens (programs of G tokens: G-token groups) that take 16-head tiles: those
    for which 64-head tiles would give fewer programs than half the SMs (32 tokens of 128 heads on
    132 SMs)."""
    tiles = head_dv_tiles(H, dv, WIDE_BLOCK_H, min(block_dv or MLA_DEFAULTS["block_dv"], dv))
    return (num_sms(device) - 1) // (2 * tiles)


def mla_config(T, H: int, D: int, dv: int, W: int, device: torch.device, **overrides) -> dict:
    """Launch config from shapes: block_h, block_dv, block_n, num_warps, num_stages, group (tokens
    per program sharing one list; whole lists only), the split of the index list: chunk (entries
    per split) and num_splits (splits actually launched), and scan (entries per load of the
    end-of-list scan). T or W symbolic (export): whole lists, no choice made from them."""
    cfg = {**MLA_DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    cfg["block_dv"] = min(cfg["block_dv"], dv)
    if cfg["block_dv"] != pow2(cfg["block_dv"]):
        raise ValueError(f"sparse_mla_attention: block_dv must be a power of two, got {cfg['block_dv']}")
    g = cfg["group"]
    if cfg["block_h"] is None:          # few tokens (a static count): narrow head tiles, more programs
        few = isinstance(T, int) and T // g <= narrow_token_limit(H, dv, device, cfg["block_dv"])
        cfg["block_h"] = NARROW_BLOCK_H if few else WIDE_BLOCK_H
    cfg["block_h"] = min(cfg["block_h"], pow2(H, 16))
    if g != pow2(g) or (isinstance(T, int) and T % g):
        raise ValueError(f"sparse_mla_attention: group must be a power of two dividing the {T} query "
                         f"tokens, got {g}")
    if g > 1:
        if not isinstance(T, int):
            raise ValueError(f"sparse_mla_attention: group {g} needs a static token count (export traces "
                             f"it symbolically)")
        if cfg.get("num_splits") not in (None, 1):
            raise ValueError(f"sparse_mla_attention: group {g} walks whole index lists; num_splits must "
                             f"be 1, got {cfg['num_splits']}")
        cfg["num_splits"] = 1
    bn = cfg["block_n"]
    if not (isinstance(T, int) and isinstance(W, int)):
        # traced with dynamic shapes (torch.export): no launch choice may depend on T or W, so the
        # lists are walked whole (the head tile: the caller's, ``sparse_mla_attention_bucketed``'s
        # torch.cond on T, else the wide one) and the end-of-list scan reads MAX_SCAN entries a load
        if cfg.get("num_splits") not in (None, 1):
            raise ValueError(f"sparse_mla_attention: an export (dynamic token count or list width) walks "
                             f"whole index lists; num_splits must be 1, got {cfg['num_splits']}")
        cfg.update(num_splits=1, chunk=W, scan=MAX_SCAN)
    else:
        if cfg.get("num_splits") is None:
            programs = T * head_dv_tiles(H, dv, cfg["block_h"], cfg["block_dv"])
            target = cfg["programs_per_sm"] * num_sms(device)
            cfg["num_splits"] = max(1, min(math.ceil(target / programs), triton.cdiv(W, bn)))
        cfg["chunk"] = max(bn, triton.cdiv(triton.cdiv(W, cfg["num_splits"]), bn) * bn)   # whole BLOCK_N steps
        cfg["num_splits"] = max(1, triton.cdiv(W, cfg["chunk"]))                        # splits actually used
        cfg["scan"] = max(bn, min(pow2(cfg["chunk"]), MAX_SCAN))
    wide = cfg["block_h"] * g >= 64 or cfg["num_splits"] > 1
    cfg["num_warps"] = cfg["num_warps"] or (8 if wide else 4)
    return cfg


def sparse_mla_attention_triton(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor,
                                scale: float, dv: int, block_h: int | None = None,
                                block_dv: int | None = None, block_n: int | None = None,
                                num_splits: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None, programs_per_sm: float | None = None,
                                prefetch: bool | None = None, group: int | None = None) -> Tensor:
    """Same contract as ``sparse_mla_attention_ref``; unset launch parameters from ``mla_config``.
    ``group`` G > 1: tokens t with equal ``t // G`` must have equal index lists (not checked)."""
    T, H, D = q.shape
    if D != pow2(D) or dv != pow2(dv) or dv > D:
        raise ValueError(f"sparse_mla_attention kernel needs power-of-two D >= dv, got D={D}, dv={dv}")
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    if T == 0 or H == 0:
        return out
    W = indices.shape[1]
    cfg = mla_config(T, H, D, dv, W, q.device, block_h=block_h, block_dv=block_dv, block_n=block_n,
                     num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm, prefetch=prefetch, group=group)
    bh, bn, bdv = cfg["block_h"], cfg["block_n"], cfg["block_dv"]
    meta = dict(D=D, DV=dv, BLOCK_H=bh, BLOCK_N=bn, BLOCK_DV=bdv, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], BLOCK_SCAN=cfg["scan"],
                PREFETCH=bool(cfg["prefetch"]))
    tiles = head_dv_tiles(H, dv, bh, bdv)
    tensors = (q.contiguous(), kv.contiguous(), indices.contiguous(), attn_sink.contiguous())
    chunk, S = cfg["chunk"], cfg["num_splits"]
    if S == 1:
        g = cfg["group"]
        launcher(sparse_mla_attention_kernel)[(T // g, tiles)](
            *tensors, out, float(scale), W, H, GROUP=g, **meta)
        return out
    part_ml = torch.empty((T, H, S, 2), dtype=torch.float32, device=q.device)
    part_acc = torch.empty((T, H, S, dv), dtype=torch.float32, device=q.device)
    launcher(sparse_mla_split_kernel)[(T, tiles, S)](
        *tensors, part_ml, part_acc, float(scale), W, H, chunk, **meta)
    launcher(sparse_mla_reduce_kernel)[(T * H,)](part_ml, part_acc, tensors[3], out, H, S, DV=dv,
                                                 BLOCK_S=pow2(S), num_warps=4)
    return out
