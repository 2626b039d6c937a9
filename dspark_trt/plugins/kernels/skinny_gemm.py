"""Decode-shape ("skinny") GEMM: ``y[M, N] = x[M, K] @ W[N, K]^T`` for M = 1..64 (issue #21).

bf16 ``x`` and weights (``nn.Linear`` layout, row-major ``[N, K]``), fp32 accumulation, output in
``x.dtype``. At these shapes the time is the weight read, so the kernel is organised around
streaming W once with enough programs in flight to saturate HBM:

* Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``. A program owns ``BLOCK_N`` weight rows
  and one ``K / SPLIT_K`` slice of K; split-K multiplies the programs where N alone gives too few
  (k/v: N = 1024), so every SM streams weights.
* Each iteration loads a ``[BLOCK_N, BLOCK_K]`` weight tile (contiguous along K: 16-byte vector
  loads) and multiplies it against the ``BLOCK_M`` rows of x:
  - ``DOT`` (M > 4 by default): ``tl.dot(w_tile, x_tile^T)`` with the weights as the *left*
    operand ("swap AB": W's rows fill the MMA's 64-row side, the few tokens the narrow side, padded
    to >= 16 as ``tl.dot`` requires); the accumulator is ``[BLOCK_N, BLOCK_M]``, stored transposed.
  - CUDA-core (M <= 4): per token ``m``, ``sum(w_tile * x[m], axis=1)`` in fp32 (no padding to 16).
    Per-column fp32 partials summed once after the K loop (the MoE decode GEMVs' body) were slower
    here on the H200 at every shape for M = 1..4 (skinny-gemm-NVIDIA-H200-32c8d2b.json.gz: o at one
    row 13.5 vs 11.9 us, gate/up 51.1 vs 48.7 us), so this body stays.
  Weight rows past N are clamped to row N-1 (the load needs no mask along N; their results are
  dropped at the store); K is masked only when ``K % BLOCK_K != 0``.
* Split-K reduction, deterministic (run-to-run bitwise identical; no float atomics):
  - ``"ticket"`` (default): every program stores its fp32 partial ``[BLOCK_N, BLOCK_M]`` into a
    workspace, then takes an atomic ticket on its output tile; the program that arrives last sums
    the ``SPLIT_K`` partials in split order 0..SPLIT_K-1 and writes y. One launch. The ticket
    counters live in a cached int32 buffer that the last program resets to 0, so it needs no
    memset per call; launches that share the buffer must not run concurrently (one stream).
    A traced call (torch.compile / export: fake tensors) reduces in two passes instead, so no fake
    tensor enters the cached counters.
  - ``"two_pass"``: programs store partials, a second tiny kernel sums them in split order. Two
    launches, no counters (the safe choice for export / several streams).
  Both sum the same partials in the same order, so they give identical results.

Configs are dicts ``{BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages}`` plus optional ``BLOCK_M``
(cap on the M tile), ``DOT`` (bool; default M > 4) and ``REDUCE`` ("ticket" / "two_pass").
``load_table`` replaces both tables by a bench JSON (``DSPARK_SKINNY_GEMM_TABLE``).
``choose_config(M, N, K)`` reads ``CONFIGS`` (keyed by (M bucket, N, K), filled from
``benchmarks/skinny_gemm_bench.py`` on an H200) and falls back to ``default_config``.
``TRITON_WINS`` says for which (M bucket, N, K) the measured kernel beats cuBLAS; ``..decode_linear``
consults it. Both tables start empty ("unmeasured"): F.linear everywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, launcher, pow2, ticket_counters, tracing

REDUCE_NONE, REDUCE_TWO_PASS, REDUCE_TICKET = 0, 1, 2
_REDUCE = {"two_pass": REDUCE_TWO_PASS, "ticket": REDUCE_TICKET}


@triton.jit
def skinny_gemm_kernel(x, w, y, ws, counter, M, N, K, K_SPLIT, SPLIT_K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT: tl.constexpr, REDUCE: tl.constexpr,
                       EVEN_K: tl.constexpr, INTERPRET_DOT: tl.constexpr):
    """Grid (N tiles, SPLIT_K, M tiles). ws: fp32 [SPLIT_K, M, N] partials (unused when SPLIT_K = 1);
    counter: int32 [N tiles * M tiles] zeros (REDUCE_TICKET only). K_SPLIT: a multiple of BLOCK_K.
    SPLIT_K is a runtime argument (one compiled kernel serves every split of a tile config)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)            # clamped rows: loads need no N mask
    rm = tl.minimum(offs_m, M - 1)
    k0 = pid_k * K_SPLIT
    k_end = tl.minimum(k0 + K_SPLIT, K)
    w_ptr = w + rn[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptr = x + rm[:, None] * stride_xm + (k0 + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptr)
        else:
            kmask = (kk + offs_k) < k_end
            wt = tl.load(w_ptr, mask=kmask[None, :], other=0.0)
        if DOT:
            if EVEN_K:
                xt = tl.load(x_ptr)
            else:
                xt = tl.load(x_ptr, mask=kmask[None, :], other=0.0)
            if INTERPRET_DOT:                                # the interpreter's bf16 tl.dot is wrong
                acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(wt, tl.trans(xt), acc)         # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]
        else:
            wf = wt.to(tl.float32)
            for m in tl.static_range(BLOCK_M):              # few tokens: CUDA-core multiply-reduce
                xrow = x + tl.minimum(pid_m * BLOCK_M + m, M - 1) * stride_xm + kk + offs_k
                if EVEN_K:
                    xm = tl.load(xrow)
                else:
                    xm = tl.load(xrow, mask=kmask, other=0.0)
                s = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)
                acc += tl.where(tl.arange(0, BLOCK_M)[None, :] == m, s[:, None], 0.0)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K

    store_split_k(acc, y, ws, counter, offs_m, offs_n, M, N, stride_ym, pid_n, pid_k, pid_m, SPLIT_K, REDUCE)


@triton.jit
def store_split_k(acc, y, ws, counter, offs_m, offs_n, M, N, stride_ym, pid_n, pid_k, pid_m, SPLIT_K,
                  REDUCE: tl.constexpr):
    """A program's fp32 ``acc [BLOCK_N, BLOCK_M]`` (rows ``offs_n``, tokens ``offs_m``) into y:
    directly (REDUCE_NONE), as split ``pid_k``'s partial in ``ws`` (REDUCE_TWO_PASS: a second
    kernel sums them), or as a partial whose tile's last-arriving program sums all ``SPLIT_K`` in
    split order and resets the tile's ticket (REDUCE_TICKET; module doc)."""
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptr = y + offs_m[None, :] * stride_ym + offs_n[:, None]
    if REDUCE == 0:                                          # SPLIT_K == 1: write y directly
        tl.store(y_ptr, acc.to(y.dtype.element_ty), mask=out_mask)
    else:
        part = offs_m[None, :] * N + offs_n[:, None]         # [M, N] offsets inside one split
        tl.store(ws + pid_k * M * N + part, acc, mask=out_mask)
        if REDUCE == 2:
            tl.debug_barrier()                               # every thread's partial is stored
            tile = counter + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:   # last program of the tile
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for s in range(SPLIT_K):                     # fixed order: deterministic
                    total += tl.load(ws + s * M * N + part, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr, total.to(y.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(tile, 0)                      # reset for the next launch


@triton.jit
def splitk_reduce_kernel(ws, y, M, N, stride_ym, SPLIT_K, BLOCK: tl.constexpr):
    """Second pass of REDUCE "two_pass": y[m, n] = sum over s = 0..SPLIT_K-1 of ws[s, m, n]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(ws + s * M * N + offs, mask=mask, other=0.0)
    tl.store(y + (offs // N) * stride_ym + offs % N, total.to(y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Configs. M buckets: a config measured at bucket b serves every M in (previous bucket, b].
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
H200_SMS = 132

# (M bucket, N, K) -> config: the winners of benchmarks/skinny_gemm_bench.py on the H200 at 78981bd
# (benchmarks/results/skinny-gemm-h200-78981bd.log.gz; Triton >= 2 % faster than cuBLAS, CUDA-graph
# replays over rotated weight copies). Everything else runs F.linear.
CONFIGS: dict[tuple[int, int, int], dict] = {
    (1, 1024, 4096): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 8},
    (1, 4096, 4096): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 4096, 12288): {'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 4},
    (1, 6144, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (1, 151936, 4096): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 3, 'DOT': False, 'SPLIT_K': 1},
    (8, 1024, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SPLIT_K': 8},
    (8, 24576, 4096): {'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 6, 'DOT': True, 'SPLIT_K': 1},
    (8, 151936, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 1},
    (16, 1024, 4096): {'BLOCK_N': 64, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'DOT': True, 'SPLIT_K': 8},
    (16, 151936, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 1},
    (32, 151936, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 1},
    (64, 151936, 4096): {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 4, 'DOT': True, 'SPLIT_K': 1},
}
# (M bucket, N, K) -> True where the Triton kernel measured faster than F.linear (cuBLAS) on the
# H200 (..decode_linear runs F.linear elsewhere, and on other GPUs until they are measured).
TRITON_WINS: dict[tuple[int, int, int], bool] = {k: True for k in CONFIGS}


def tables_from_rows(rows: list[dict], win: float = 0.02) -> tuple[dict, dict]:
    """``benchmarks/skinny_gemm_bench.py``'s JSON rows -> (CONFIGS, TRITON_WINS) entries: per
    (M bucket, N, K) the fastest correct config, and whether it beat cuBLAS by ``win``."""
    configs, wins = {}, {}
    for r in rows:
        if "best_config" in r:
            key = (m_bucket(int(r["M"])), int(r["N"]), int(r["K"]))
            configs[key] = dict(r["best_config"])
            wins[key] = r["triton_us"] * (1 + win) <= r["cublas_us"]
    return configs, wins


def load_table(path: str) -> int:
    """Replace ``CONFIGS`` / ``TRITON_WINS`` by a skinny-GEMM bench's measurement (its JSON file, e.g.
    one made on this GPU); returns the number of shapes it routes to Triton. Raises ValueError
    naming the file when it is not such a measurement."""
    import json
    try:
        doc = json.loads(open(path).read())
        configs, wins = tables_from_rows(doc["rows"], float(doc.get("win", 0.02)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"skinny-GEMM table {path!r}: not a skinny_gemm_bench.py result ({e})") from e
    CONFIGS.clear(), CONFIGS.update(configs)
    TRITON_WINS.clear(), TRITON_WINS.update(wins)
    return sum(wins.values())


def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    return M_BUCKETS[-1]


def default_config(M: int, N: int, K: int, sms: int = H200_SMS) -> dict:
    """Unmeasured shapes: CUDA-core body for M <= 4 (32 rows x 256 K per tile: 16 KB of bf16),
    swap-AB tl.dot for more tokens (64 rows x 128 K); split K until >= 2 programs per SM, keeping
    >= 4 tiles of K per split."""
    dot = M > 4
    bn, bk = (64, 128) if dot else (32, 256)
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, 64)
    split = 1
    while tiles * split < 2 * sms and K // (2 * split * bk) >= 4:
        split *= 2
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 4 if dot else 3,
            "DOT": dot}


def choose_config(M: int, N: int, K: int) -> dict:
    """The measured config for (M bucket, N, K), else ``default_config``."""
    return dict(CONFIGS.get((m_bucket(M), N, K)) or default_config(M, N, K))


def skinny_gemm(x: Tensor, w: Tensor, config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """``x[M, K] @ w[N, K]^T`` -> ``[M, N]`` in x.dtype (fp32 accumulation). ``w`` must be
    row-major; ``x`` contiguous along K. ``config``: see the module doc (None: ``choose_config``)."""
    M, K = x.shape
    N, K2 = w.shape
    if K != K2:
        raise ValueError(f"skinny_gemm: x has K={K}, w has K={K2}")
    if w.stride(1) != 1:
        w = w.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = dict(config) if config is not None else choose_config(M, N, K)
    bn, bk, split = int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"]), int(cfg.get("SPLIT_K", 1))
    dot = bool(cfg.get("DOT", M > 4))
    bm_cap = int(cfg.get("BLOCK_M", 64))
    bm = max(16, min(pow2(M), pow2(bm_cap))) if dot else min(pow2(M), pow2(bm_cap))
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M * N == 0:
        return y
    plan = SplitK.plan(M, N, K, bm, bn, bk, split, cfg.get("REDUCE", "ticket"), x.device)
    launcher(skinny_gemm_kernel)[plan.grid](
        x, w, y, plan.ws, plan.counter, M, N, K, plan.k_split, plan.split, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT=dot, REDUCE=plan.reduce,
        EVEN_K=(K % bk == 0), INTERPRET_DOT=INTERPRET, num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 3)))
    return plan.finish(y)


class SplitK:
    """A split-K launch's plan: grid ``(N tiles, splits, M tiles)``, K slice per split (a multiple
    of BLOCK_K; trailing splits may be empty: they store zeros), the reduction and its buffers."""

    def __init__(self, grid, k_split, split, reduce, ws, counter):
        self.grid, self.k_split, self.split, self.reduce, self.ws, self.counter = \
            grid, k_split, split, reduce, ws, counter

    @staticmethod
    def slices(K: int, bk: int, split: int) -> tuple[int, int]:
        """(K per split: a multiple of bk, the splits that hold any K) for ``split`` asked."""
        k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
        return k_split, triton.cdiv(K, k_split)

    @classmethod
    def plan(cls, M, N, K, bm, bn, bk, split, reduce_name, device, k_split: int | None = None) -> "SplitK":
        """``k_split`` given: exactly ``split`` splits of that K slice (kernels that slice K their
        own ways in one grid, trailing splits empty); else ``slices(K, bk, split)``."""
        if split > 1 and reduce_name not in _REDUCE:
            raise ValueError(f"REDUCE must be one of {sorted(_REDUCE)}, got {reduce_name!r}")
        if k_split is None:
            k_split, split = cls.slices(K, bk, split)
        reduce = REDUCE_NONE if split == 1 else _REDUCE[reduce_name]
        if reduce == REDUCE_TICKET and tracing():    # a traced call must not cache (fake) counters
            reduce = REDUCE_TWO_PASS
        grid = (triton.cdiv(N, bn), split, triton.cdiv(M, bm))
        ws = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=device)
        counter = ticket_counters(device, grid[0] * grid[2]) if reduce == REDUCE_TICKET else ws
        return cls(grid, k_split, split, reduce, ws, counter)

    def finish(self, y: Tensor) -> Tensor:
        """The two-pass reduction's second launch (no-op otherwise); returns y."""
        if self.reduce == REDUCE_TWO_PASS:
            M, N = y.shape
            block = 1024
            launcher(splitk_reduce_kernel)[(triton.cdiv(M * N, block),)](
                self.ws, y, M, N, y.stride(0), self.split, BLOCK=block, num_warps=4)
        return y
