"""Triton kernels of ``dspark::block_attention``: flash-decoding GQA over a paged KV cache.

A program owns (row b, KV head, tile of BLOCK_T queries, KV split s): its BLOCK_T * G query heads
(G = H / Hkv) share every K/V tile they load. The keys ``[0, hi)`` (hi = 1 + the tile's largest
``kv_limit``, read on the device) are cut into NUM_SPLITS equal BLOCK_N-aligned ranges, so a
decode step at batch 1 still spreads over every SM. Each query masks keys beyond its own limit.
Online softmax in fp32 (base 2: scale * log2(e) folded into the scores), fp32 accumulation.
Variants (launch keys ``prefetch``, ``kvh_first``): page-table lookups one tile ahead, so that
Triton pipelines the K/V loads ``num_stages - 1`` deep; grid with the KV head as fastest axis.

* ``NUM_SPLITS == 1``: the program normalises and writes the output (``block_attention_kernel``,
  also the TensorRT AOT entry).
* ``NUM_SPLITS > 1``: each split writes its partial (m, l, acc) to an fp32 workspace sized from
  shapes, and the splits are merged (no host sync, graph-safe) either by the tile's last-arriving
  split program (``reduce="ticket"``, one launch: an atomic ticket per query tile in the cached
  counters of ``common.ticket_counters``; splits left without keys store nothing and the merge reads
  only the splits that have keys) or by ``block_attention_reduce_kernel`` (``"two_pass"``, the
  default: measured faster, see ``ATTN_DEFAULTS``; traced calls, e.g. an exported engine, always use
  it, since cached counters cannot live in a trace).

Inert queries (position < 0, row without pages) write zeros.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import gdc_launch_dependents, gdc_wait, launcher, num_sms, pdl_launch, pow2, ticket_counters, tracing


@triton.jit
def _kv_rows(block_table, b, P, kpos, PAGE_SIZE, PAD_PAGE, kvh, HKV: tl.constexpr, D: tl.constexpr):
    """Element offsets [BLOCK_N] (int64) of the cache rows of keys ``kpos`` (int32) for KV head
    ``kvh``; keys past the block table point at row 0 (callers mask their K/V loads)."""
    page = tl.load(block_table + b * P + kpos // PAGE_SIZE, mask=kpos < P * PAGE_SIZE, other=0)
    page = tl.where(page >= 0, page, PAD_PAGE)
    return ((page * PAGE_SIZE + kpos % PAGE_SIZE) * HKV + kvh) * D


@triton.jit
def _split_chunk(lim, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """(hi, chunk): the tile's keys [0, hi) (hi = 1 + its largest limit) and the BLOCK_N-aligned
    keys per split; split s holds [s * chunk, min((s + 1) * chunk, hi)), empty once s * chunk >= hi."""
    hi = tl.max(lim) + 1
    return hi, tl.cdiv(tl.cdiv(hi, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _attend_split(q, k_cache, v_cache, block_table, positions, kv_limit, qk_scale, b, kvh, t0, split,
                  T, P, PAGE_SIZE, PAD_PAGE, NUM_SPLITS,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                  q_index, INDEXED: tl.constexpr):
    """Online softmax of the tile's BLOCK_T * G query rows over split ``split`` of the keys, in base 2
    (``qk_scale`` = scale * log2(e)). Returns (m [BLOCK_M] (log2 domain), l [BLOCK_M],
    acc [BLOCK_M, D] unnormalised, lim, q_off, t, h, tmask, qmask): ``q_off`` / ``qmask`` the
    element offsets and mask of the rows' q (and output) in ``q``; ``tmask`` the query tokens that
    exist in the [B, T] layout (their partials).

    INDEXED: q (and the output) are packed rows of the tokens of every batch row, ``q_index``
    [B, T] (int32) the packed row of token (b, t), -1 for none (its position is then < 0 too):
    the packed verify's slots grouped back into their rows, so a row's cache is read once for all
    of its tokens.

    PDL: the step's index inputs (positions, kv_limit, the block table, so the split's key range
    and its first tile's cache rows) are read before ``gdc_wait``, q and the cache contents after:
    a dependent launch (the token chain) must not have them written by the kernel just before it
    (the chain's are the step's inputs), and their loads leave the critical path.

    PREFETCH: the page-table lookup of tile i + 1 happens in iteration i, so the K/V addresses of a
    tile do not depend on a load of the same iteration. Triton's software pipeliner then keeps
    num_stages - 1 K/V tiles in flight (cp.async); with the lookup in the same iteration it keeps
    a single buffer whatever num_stages says."""
    G: tl.constexpr = H // HKV
    BLOCK_M: tl.constexpr = BLOCK_T * G
    qk_scale = tl.cast(qk_scale, tl.float32)  # AOTInductor passes Python floats as fp64 (Triton 3.6)
    rows = tl.arange(0, BLOCK_M)
    t = t0 + rows // G                                       # query token of each row
    h = kvh * G + rows % G                                   # query head of each row
    tmask = t < T
    first_page = tl.load(block_table + b * P)
    pos = tl.load(positions + b * T + t, mask=tmask, other=-1)
    lim = tl.load(kv_limit + b * T + t, mask=tmask, other=-1)
    lim = tl.where(pos >= 0, lim, -1)                        # [BLOCK_M], -1 = inert
    lim = tl.where(first_page >= 0, lim, -1)
    lim = tl.minimum(tl.maximum(lim, -1), P * PAGE_SIZE - 1).to(tl.int32)   # int32 key math (cheap div/mod)

    hi, chunk = _split_chunk(lim, NUM_SPLITS, BLOCK_N)     # keys [0, hi) matter to this tile
    lo = split * chunk
    end = tl.minimum(lo + chunk, hi)
    kv_next = _kv_rows(block_table, b, P, lo + tl.arange(0, BLOCK_N), PAGE_SIZE, PAD_PAGE, kvh, HKV, D)
    if PDL:
        gdc_wait()                                           # q and this step's K / V rows are written

    d = tl.arange(0, D)
    if INDEXED:
        slot = tl.load(q_index + b * T + t, mask=tmask, other=-1)
        qmask = tmask & (slot >= 0)
        q_off = (tl.maximum(slot, 0).to(tl.int64) * H + h) * D
    else:
        qmask = tmask
        q_off = ((b * T + t).to(tl.int64) * H + h) * D
    qt = tl.load(q + q_off[:, None] + d[None, :], mask=qmask[:, None], other=0.0)   # [BLOCK_M, D]
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < end
        if PREFETCH:
            kv_off = kv_next
            kv_next = _kv_rows(block_table, b, P, kpos + BLOCK_N, PAGE_SIZE, PAD_PAGE, kvh, HKV, D)
        else:
            kv_off = _kv_rows(block_table, b, P, kpos, PAGE_SIZE, PAD_PAGE, kvh, HKV, D)
        kt = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        vt = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee").to(tl.float32) * qk_scale   # [BLOCK_M, BLOCK_N]
        s = tl.where(kpos[None, :] <= lim[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc, lim, q_off, t, h, tmask, qmask


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Programmatic dependent launch: let the next kernel launch, then wait for the previous one
    (q and the cache rows it wrote are read right after)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _row_and_head(KVH_FIRST: tl.constexpr):
    """(b, kvh) of this program: grid axes (B, Hkv) or, KVH_FIRST, (Hkv, B) so that programs that
    run at the same time read neighbouring 256-byte head slices of the same cache rows."""
    if KVH_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def block_attention_kernel(q, k_cache, v_cache, block_table, positions, kv_limit, out, scale,
                           T, P, PAGE_SIZE, PAD_PAGE,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           PREFETCH: tl.constexpr = False, KVH_FIRST: tl.constexpr = False,
                           PDL: tl.constexpr = False, q_index=None, INDEXED: tl.constexpr = False):
    """Grid (B, Hkv, cdiv(T, BLOCK_T)) (KVH_FIRST: (Hkv, B, ...)): one split, normalised output."""
    if PDL:
        gdc_launch_dependents()                              # the wait: in _attend_split
    b, kvh = _row_and_head(KVH_FIRST)
    m_i, l_i, acc, lim, q_off, t, h, tmask, qmask = _attend_split(
        q, k_cache, v_cache, block_table, positions, kv_limit, scale * LOG2E, b, kvh,
        tl.program_id(2) * BLOCK_T, 0, T, P, PAGE_SIZE, PAD_PAGE, 1, H, HKV, D, BLOCK_T, BLOCK_N, PREFETCH, PDL,
        q_index, INDEXED)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    o = tl.where((lim >= 0)[:, None], o, 0.0)
    d = tl.arange(0, D)
    tl.store(out + q_off[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=qmask[:, None])


@triton.jit
def block_attention_split_kernel(q, k_cache, v_cache, block_table, positions, kv_limit, part_ml, part_acc,
                                 out, counter, scale, T, P, PAGE_SIZE, PAD_PAGE, NUM_SPLITS,
                                 H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                 PREFETCH: tl.constexpr = False, KVH_FIRST: tl.constexpr = False,
                                 TICKET: tl.constexpr = False, PDL: tl.constexpr = False,
                                 q_index=None, INDEXED: tl.constexpr = False):
    """Grid (B, Hkv, cdiv(T, BLOCK_T) * NUM_SPLITS) (KVH_FIRST: (Hkv, B, ...)); partials
    part_ml [B, T, H, S, 2] (m in log2 units, l) and part_acc [B, T, H, S, D], S = NUM_SPLITS.
    TICKET: the query tile's last-arriving split merges its splits into ``out`` (``counter``: int32
    zeros, one per (row, KV head, query tile), left at zero); else ``out`` is unused and
    ``block_attention_reduce_kernel`` merges."""
    if PDL:
        gdc_launch_dependents()                              # the wait: in _attend_split
    b, kvh = _row_and_head(KVH_FIRST)
    split = tl.program_id(2) % NUM_SPLITS
    t_tile = tl.program_id(2) // NUM_SPLITS
    m_i, l_i, acc, lim, q_off, t, h, tmask, qmask = _attend_split(
        q, k_cache, v_cache, block_table, positions, kv_limit, scale * LOG2E, b, kvh, t_tile * BLOCK_T, split,
        T, P, PAGE_SIZE, PAD_PAGE, NUM_SPLITS, H, HKV, D, BLOCK_T, BLOCK_N, PREFETCH, PDL, q_index, INDEXED)
    row = ((b * T + t).to(tl.int64) * H + h) * NUM_SPLITS                     # [BLOCK_M] slot of split 0
    d = tl.arange(0, D)
    hi, chunk = _split_chunk(lim, NUM_SPLITS, BLOCK_N)
    live = tl.where(hi > 0, tl.cdiv(hi, tl.maximum(chunk, 1)), 0)             # splits that hold keys
    if TICKET:
        smask = tmask & (tl.zeros_like(lim) + split < live)   # splits without keys store nothing
    else:
        smask = tmask
    tl.store(part_ml + (row + split) * 2, m_i, mask=smask)
    tl.store(part_ml + (row + split) * 2 + 1, l_i, mask=smask)
    tl.store(part_acc + (row + split)[:, None] * D + d[None, :], acc, mask=smask[:, None])
    if TICKET:
        tl.debug_barrier()                                   # every thread's partial is stored
        tile = counter + (b * HKV + kvh) * tl.cdiv(T, BLOCK_T) + t_tile
        if tl.atomic_add(tile, 1, sem="acq_rel") == NUM_SPLITS - 1:   # the tile's last split
            m_run = tl.full(m_i.shape, -1.0e30, tl.float32)
            l_run = tl.zeros(l_i.shape, tl.float32)
            o = tl.zeros(acc.shape, tl.float32)
            for s in range(live):                            # split order: deterministic
                m_s = tl.load(part_ml + (row + s) * 2, mask=tmask, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(part_ml + (row + s) * 2 + 1, mask=tmask, other=0.0, cache_modifier=".cg")
                a_s = tl.load(part_acc + (row + s)[:, None] * D + d[None, :], mask=tmask[:, None],
                              other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_s)
                alpha = tl.exp2(m_run - m_new)
                beta = tl.exp2(m_s - m_new)
                l_run = l_run * alpha + l_s * beta
                o = o * alpha[:, None] + a_s * beta[:, None]
                m_run = m_new
            o = o / tl.maximum(l_run, 1e-30)[:, None]
            o = tl.where((lim >= 0)[:, None], o, 0.0)
            tl.store(out + q_off[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=qmask[:, None])
            tl.atomic_xchg(tile, 0)                          # reset for the next launch


@triton.jit
def block_attention_reduce_kernel(part_ml, part_acc, out, NUM_SPLITS, D: tl.constexpr,
                                  BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
                                  q_index=None, H: tl.constexpr = 1, INDEXED: tl.constexpr = False):
    """Grid (B * T * H,): merge the NUM_SPLITS partials of one (query, head) into its output row
    (INDEXED: row ``q_index[b, t]`` of the packed output, none for -1). Inert rows have l = 0 in
    every split and come out 0."""
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    m = tl.load(part_ml + (row * NUM_SPLITS + s) * 2, mask=smask, other=-1.0e30)
    l_s = tl.load(part_ml + (row * NUM_SPLITS + s) * 2 + 1, mask=smask, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(part_acc + (row * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=smask[:, None],
                  other=0.0)                                                        # [BLOCK_S, D]
    w = tl.exp2(m - tl.max(m, 0))                                                   # [BLOCK_S]
    o = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l_s * w, 0), 1e-30)
    if INDEXED:
        slot = tl.load(q_index + row // H)
        tl.store(out + (tl.maximum(slot, 0).to(tl.int64) * H + row % H) * D + d, o.to(out.dtype.element_ty),
                 mask=(tl.zeros([D], tl.int32) + slot) >= 0)
    else:
        tl.store(out + row * D + d, o.to(out.dtype.element_ty))


EXPORT_NUM_SPLITS = 8     # fixed split count of exported (dynamic-shape) engines

# Defaults, from benchmarks/tune_plugins.py on an H200 (tune-plugins-NVIDIA_H200-7e0cc94.json.gz):
# page lookups one tile ahead (prefetch) let Triton pipeline K/V num_stages - 1 deep; at block_n 64,
# 4 warps, 3 stages a program takes 204 registers x 128 threads and 76 KB of shared memory, so an SM
# holds 2 (programs_per_sm, from ptxas for sm_90), and the key range is split so that the grid
# fills whole waves of them; kvh_first puts the KV head on the fastest grid axis. B=64 ctx 4096
# T=8: 72.6 % of HBM peak with 16-token pages, 76.5 % with 64-token pages (was 65 / 66 %).
# reduce: "two_pass". The one-launch "ticket" merge was slower on the H200 in the compiled Qwen3-8B
# decode step (batch 1, 128-token context, 3 splits: 6.4 us per layer against 3.8 + 1.5 us for the
# split and reduce kernels; profile-compiled-b1-6bc209a.json.gz): the tile's last split merges
# serially after an atomic round trip, where the reduce kernel merges every head in parallel.
ATTN_DEFAULTS = dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2, prefetch=True, kvh_first=True,
                     reduce="two_pass")


SPLITS_ENV = "DSPARK_ATTN_SPLITS"   # a fixed KV split count for every eager launch (read at call time)


def env_num_splits() -> int | None:
    """``DSPARK_ATTN_SPLITS``: the split count of every shape-static launch (benchmarks compare split
    policies through ``LLM`` with it); unset or empty: ``default_num_splits``."""
    v = os.environ.get(SPLITS_ENV, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{SPLITS_ENV}={v!r}: set it to a positive integer or leave it unset")
    return int(v)


def default_num_splits(device: torch.device, programs: int, max_keys: int, block_n: int,
                       programs_per_sm: int = ATTN_DEFAULTS["programs_per_sm"]) -> int:
    """KV splits per query tile. Less than a wave of programs: the most splits that keep the grid
    within one wave (``programs_per_sm`` programs per SM). One more would start a second, mostly empty
    wave: on an H100 at Qwen3-8B dims, batch 16 (128 programs), 3 splits took the AR step through
    ``LLM`` 6.89 ms and the 8-token verify 7.99, 2 splits 6.75 and 7.51 (and 2 were the fastest of
    1 / 2 / 4 / 8 for the chain at 128 and at 8192 tokens; token-step-...-d399ea4). A wave or more:
    the fewest splits (up to 8) whose last wave is at least 90 % full, else the fullest."""
    sms = num_sms(device)
    slots = programs_per_sm * sms
    most = max(1, min(triton.cdiv(max_keys, block_n), 64))
    if programs < slots:
        return max(1, min(slots // programs, most))
    best, best_fill = 1, 0.0
    for s in range(1, min(most, 8) + 1):
        total = programs * s
        fill = total / (triton.cdiv(total, slots) * slots)
        if fill >= 0.9:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


def block_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                           positions: Tensor, kv_limit: Tensor, scale: float,
                           num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           programs_per_sm: int | None = None, prefetch: bool | None = None,
                           kvh_first: bool | None = None, reduce: str | None = None,
                           pdl: bool = False, q_index: Tensor | None = None) -> Tensor:
    """Same contract as ``block_attention_ref``. Unset launch parameters come from
    ``ATTN_DEFAULTS``; ``num_splits`` (KV splits per query tile) from ``DSPARK_ATTN_SPLITS``
    (``env_num_splits``), else ``default_num_splits``. The
    actual key range of each split is decided on the device from ``kv_limit``, so the split count
    only depends on shapes. ``reduce``: how splits merge, "ticket" or "two_pass" (module doc; traced
    calls always use "two_pass"). ``pdl``: every launch with programmatic dependent launch (sm_90+;
    the chain of ``runtime/token_step.py``). ``q_index`` [B, T] (int32): q is packed, ``[R, ..., H, D]``
    (R rows, any middle dims of size 1) and token (b, t) is its row ``q_index[b, t]`` (-1: none; such
    a token's position must be < 0), the output has q's shape and rows no token names are zero
    (``grouped_block_attention``)."""
    pdl_kw = pdl_launch(pdl, "block_attention", q)
    block_n = block_n or ATTN_DEFAULTS["block_n"]
    num_warps = num_warps or ATTN_DEFAULTS["num_warps"]
    num_stages = num_stages or ATTN_DEFAULTS["num_stages"]
    programs_per_sm = programs_per_sm or ATTN_DEFAULTS["programs_per_sm"]
    prefetch = ATTN_DEFAULTS["prefetch"] if prefetch is None else bool(prefetch)
    kvh_first = ATTN_DEFAULTS["kvh_first"] if kvh_first is None else bool(kvh_first)
    reduce = reduce or ATTN_DEFAULTS["reduce"]
    if reduce not in ("ticket", "two_pass"):
        raise ValueError(f"block_attention: reduce must be 'ticket' or 'two_pass', got {reduce!r}")
    packed_shape = q.shape
    if q_index is not None:       # view the packed rows as a [1, R] batch for the checks below
        if q_index.shape != positions.shape:
            raise ValueError(f"block_attention: q_index {tuple(q_index.shape)} must have the shape of "
                             f"positions {tuple(positions.shape)}")
        q = q.reshape(1, -1, *q.shape[-2:])
    B, T, H, D = q.shape
    if q_index is not None:
        B, T = positions.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv if Hkv else 0
    if G == 0 or H % Hkv or G != pow2(G) or D != pow2(D):
        raise ValueError(f"block_attention kernel needs H / Hkv and the head dim to be powers of two, "
                         f"got H={H}, Hkv={Hkv}, D={D}")
    out = (torch.empty if q_index is None else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0 or B * T == 0:
        return out.view(packed_shape)
    index = dict(q_index=positions if q_index is None else q_index.to(torch.int32).contiguous(),
                 INDEXED=q_index is not None)
    P, page = block_table.shape[1], k_cache.shape[1]
    if all(isinstance(n, int) for n in (B, T, P)):
        block_t = max(pow2(16 // G), min(pow2(T), max(1, 64 // G)))   # BLOCK_T * G in [16, 64] (tl.dot)
        t_tiles = triton.cdiv(T, block_t)
        S = num_splits or env_num_splits() or default_num_splits(q.device, B * Hkv * t_tiles, P * page, block_n,
                                                                 programs_per_sm)
    else:   # traced with dynamic shapes (torch.export): launch choices must not depend on them
        block_t = max(pow2(16 // G), max(1, 64 // G))
        t_tiles = triton.cdiv(T, block_t)
        S = num_splits or EXPORT_NUM_SPLITS
    tensors = (q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_table.contiguous(),
               positions.contiguous(), kv_limit.contiguous())
    meta = dict(H=H, HKV=Hkv, D=D, BLOCK_T=block_t, BLOCK_N=block_n, PREFETCH=prefetch, KVH_FIRST=kvh_first,
                num_warps=num_warps, num_stages=num_stages, PDL=pdl, **pdl_kw)
    rows_heads = (Hkv, B) if kvh_first else (B, Hkv)
    if S == 1:
        launcher(block_attention_kernel)[(*rows_heads, t_tiles)](
            *tensors, out, float(scale), T, P, page, k_cache.shape[0] - 1, **meta, **index)
        return out.view(packed_shape)
    part_ml = torch.empty((B, T, H, S, 2), dtype=torch.float32, device=q.device)
    part_acc = torch.empty((B, T, H, S, D), dtype=torch.float32, device=q.device)
    ticket = reduce == "ticket" and not tracing()
    counter = ticket_counters(q.device, B * Hkv * t_tiles) if ticket else part_ml
    launcher(block_attention_split_kernel)[(*rows_heads, t_tiles * S)](
        *tensors, part_ml, part_acc, out, counter, float(scale), T, P, page, k_cache.shape[0] - 1, S,
        TICKET=ticket, **meta, **index)
    if not ticket:
        launcher(block_attention_reduce_kernel)[(B * T * H,)](
            part_ml, part_acc, out, S, D=D, BLOCK_S=pow2(S), num_warps=4, PDL=pdl, H=H, **pdl_kw, **index)
    return out.view(packed_shape)
