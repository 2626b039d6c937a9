"""Launch of the exact Markov sampler (kernels: ``markov_exact.py``): the defaults and measured
per-batch tables (``MARKOV_DEFAULTS``, ``MARKOV_SMALL_B``, ``MARKOV_B1``, ``ONE_LAUNCH_B``),
``markov_config`` (shapes -> launch parameters), the residency cut of one-launch grids
(``resident_grid``), and ``markov_sample_triton``, which runs a schedule.
"""
from __future__ import annotations

import torch
import triton
from torch import Tensor

from .common import INTERPRET, launcher, max_resident_programs, num_sms, pow2
from .markov_exact import markov_rows_kernel, markov_sample_kernel, markov_step_kernel

# Defaults of the exact sampler's launch (benchmarks/tune_plugins.py measures alternatives).
# block_v / block_r: W2 tile of the dot body (the gemv body takes the whole rank and, unless given,
# block_v = GEMV_TILE_ELEMS // rank: 16 KB of bf16 per program, ~64 registers per thread at 8 warps);
# programs_per_sm: target programs per SM of the per-step schedules; resident_per_sm: programs per SM
# of the one-launch schedule (clamped to what fits);
# packed (one_launch): a program folds its best (score, index) into the step's slot with one
# atomic_max and the next step reads it back with one load; False: per-program partials that every
# program reduces after the barrier;
# reduce: "ticket" or "prologue" (per-step schedules); gemv: CUDA-core body for batches <= GEMV_MAX_B;
# pipeline (gemv): load the next W2 and U tiles before reducing the current one;
# l2_keep (gemv): fraction of each step's sweep loaded evict_last, the rest evict_first (with snake,
# the next step starts on the kept tiles; W2 of Qwen3-8B is 78 MB, the H200's L2 60 MB).
MARKOV_DEFAULTS = dict(one_launch=False, block_v=128, block_r=64, programs_per_sm=4, resident_per_sm=1,
                       reduce="ticket", gemv=False, pipeline=False, snake=False, l2_keep=0.0, num_warps=None,
                       num_stages=3, packed=True)
# Overrides of MARKOV_DEFAULTS for batches up to GEMV_MAX_B; empty = the same defaults for every batch.
MARKOV_SMALL_B: dict = dict(reduce="prologue", snake=True)   # H200, B=1 V=151936 r=256: 200 vs 219 us
# The batch-1 schedule, used unless the caller picks one_launch or gemv itself. H200, B=1 N=7, cold
# L2 (benchmarks/markov_l2.py, markov-l2-NVIDIA_H200-1471c02.json.gz): V=151936 r=256 138 us greedy
# (83% of 4.8 TB/s), 146 us sampled (T=0.8); 151 us with per-program partials instead of the packed
# atomic_max (packed=False), 144 us without pipeline, 198 us of MARKOV_SMALL_B's per-step launches;
# 169 us of 7 torch.mv (cuBLAS GEMV), 186 us of 7 plain reads of W2 (torch.sum). Pipelining only
# pays while two tiles in flight leave room for enough programs: V=129280 r=512 (16 KB tiles) 229 us
# without, 230 us with (3 programs per SM instead of 4). Batches 2..4 keep MARKOV_SMALL_B (B=4 in one
# launch: 741 vs 348 us, markov-l2-NVIDIA_H200-f4e9738.json.gz).
MARKOV_B1: dict = dict(one_launch=True, gemv=True, block_v=16, num_warps=4, resident_per_sm=6, snake=True,
                       pipeline=True)
# Batches ONE_LAUNCH_B[0]..ONE_LAUNCH_B[1] run the tensor-core body in one launch (same file,
# V=151936 r=256: B=32 480 vs 548 us per step, B=64 644 vs 856 us; B=16 408 vs 364 and B=8 398 vs
# 355 us stay per step; larger batches are not measured).
ONE_LAUNCH_B = (32, 64)
# Batches above 32 (one row group of 64) in that launch take W2 tiles of rank 128: H100, B=64 N=7
# V=151936 r=256, graph replays, 617 vs 663 us sampled and 413 vs 445 us all greedy (the best of 16
# configs either way; tune-plugins-NVIDIA_H100_80GB_HBM3-cb3c737.json.gz).
ONE_LAUNCH_B64 = dict(block_r=128)
SLOTS_OFFSET = 16         # int64s between the barrier counter and the packed slots: another 128-byte line
PIPELINE_MAX_TILE = 4096   # W2 elements per gemv tile up to which MARKOV_B1 pipelines (8 KB of bf16)
GEMV_MAX_B = 4
GEMV_TILE_ELEMS = 8192


EXPORT_ROWS_HINT = 16      # exported engines: row tiles of 16 (batch-independent), per-step schedule


def markov_config(B: int, V: int, R: int, device: torch.device, **overrides) -> dict:
    """Launch config of the exact sampler from shapes; ``overrides`` (not None) replace defaults.
    Adds block_b (rows per program), groups, C (programs per row group) and num_warps."""
    given = {k: v for k, v in overrides.items() if v is not None}
    small = MARKOV_SMALL_B if B <= GEMV_MAX_B else {}
    b1 = MARKOV_B1 if B == 1 and not {"one_launch", "gemv"} & set(given) else {}
    large = dict(one_launch=True) if ONE_LAUNCH_B[0] <= B <= ONE_LAUNCH_B[1] else {}
    if large and B > 32:
        large.update(ONE_LAUNCH_B64)
    cfg = {**MARKOV_DEFAULTS, **small, **large, **b1, **given}
    one_launch = cfg["one_launch"]
    if cfg["reduce"] not in ("ticket", "prologue"):
        raise ValueError(f"markov_sample: reduce must be 'ticket' or 'prologue', got {cfg['reduce']!r}")
    gemv = bool(cfg["gemv"]) and B <= GEMV_MAX_B
    cfg["gemv"] = gemv
    if gemv:
        cfg["block_b"] = pow2(B)
        cfg["block_r"] = pow2(R, 16)
        cfg["block_v"] = (given.get("block_v") or b1.get("block_v") or small.get("block_v")   # not the dot tile's
                          or max(16, GEMV_TILE_ELEMS // cfg["block_r"]))
        if b1 and "pipeline" not in given and cfg["block_v"] * cfg["block_r"] > PIPELINE_MAX_TILE:
            cfg["pipeline"] = False
    else:
        cfg["block_b"] = min(pow2(B, 16), 64)
        cfg["block_r"] = min(cfg["block_r"], pow2(R, 16))
    cfg["groups"] = triton.cdiv(B, cfg["block_b"])
    n_tiles = triton.cdiv(V, cfg["block_v"])
    if cfg.get("num_programs"):
        C = cfg["num_programs"]
    elif one_launch:                            # all programs resident: resident_per_sm per SM
        C = max(1, cfg["resident_per_sm"] * num_sms(device) // cfg["groups"])
    else:                                       # ~programs_per_sm per SM (one wave), whole tiles each
        per_program = triton.cdiv(n_tiles, cfg["programs_per_sm"] * num_sms(device))
        C = triton.cdiv(n_tiles, per_program)
    cfg["C"] = C
    cfg["num_warps"] = cfg["num_warps"] or (8 if gemv or cfg["block_b"] > 16 else 4)
    return cfg


_FIT_CACHE: dict = {}


def _int_specialisation(args) -> tuple:
    """How Triton specialises the integer arguments of a launch (equal to 1, multiple of 16): each
    specialisation is its own compiled kernel, with its own register count."""
    return tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int) and not isinstance(a, bool))


def _resident_c(head, C, groups, dev, N, strides, meta) -> int:
    """C cut to what the compiled one-launch kernel lets every SM hold; compiled again for the new C
    (a C that specialises differently may change the registers). The fit is cached per compiled
    variant: dtypes, constexprs and the specialisation of every integer argument (N = 1 differs)."""
    for _ in range(3):
        key = (dev.index, _int_specialisation((*head, C, 0, N, *strides)), tuple(sorted(meta.items())),
               tuple(str(t.dtype) for t in head if isinstance(t, torch.Tensor)))
        if key not in _FIT_CACHE:
            compiled = markov_sample_kernel.warmup(*head, C, 0, N, *strides, grid=(C, groups), **meta)
            _FIT_CACHE[key] = max_resident_programs(compiled, dev)
        cut = resident_grid(C, groups, _FIT_CACHE[key], num_sms(dev))
        if cut == C:
            return C
        C = cut
    return C


def resident_grid(C: int, groups: int, fit_per_sm: int, sms: int) -> int:
    """Programs per row group of a one-launch grid, cut so that all ``C * groups`` are resident at
    once (a grid barrier over a program that cannot be scheduled never returns)."""
    if fit_per_sm * sms < groups:
        raise RuntimeError(f"markov_sample one_launch: {groups} row groups cannot all be resident "
                           f"({fit_per_sm} programs per SM fit); use the per-step schedule")
    return min(C, fit_per_sm * sms // groups)


def markov_sample_triton(U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                         seed: Tensor, start: Tensor, one_launch: bool | None = None, rows_only: bool = False,
                         num_programs: int | None = None, block_v: int | None = None,
                         block_r: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, reduce: str | None = None, gemv: bool | None = None,
                         snake: bool | None = None, programs_per_sm: int | None = None,
                         l2_keep: float | None = None, resident_per_sm: int | None = None,
                         pipeline: bool | None = None, packed: bool | None = None,
                         z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Exact full-vocabulary Markov sampler; same contract as ``markov_sample_ref``.

    The grid is (C, row groups): C programs split the vocabulary, axis 1 splits the rows. Schedules
    and options: see the module doc; unset options come from ``markov_config``. ``rows_only`` runs
    ``markov_rows_kernel`` (one program per row group, the schedule of the TensorRT AOT plugin).
    ``z_out``: a contiguous fp32 [B, N, V] buffer to write z to (returned as z)."""
    B, N, V = U.shape
    Rk = w1.shape[1]
    dev = U.device
    tokens = torch.empty((B, N), dtype=torch.int64, device=dev)
    if z_out is not None and (tuple(z_out.shape) != (B, N, V) or z_out.dtype != torch.float32
                              or not z_out.is_contiguous() or z_out.device != dev):
        raise ValueError(f"markov_sample: z_out must be a contiguous float32 {(B, N, V)} tensor on {dev}, got "
                         f"{z_out.dtype} {tuple(z_out.shape)} on {z_out.device}")
    z = torch.empty((B, N, V), dtype=torch.float32, device=dev) if z_out is None else z_out
    if B == 0 or N == 0:
        return tokens, z
    if U.stride(-1) != 1:
        U = U.contiguous()
    static = isinstance(B, int)
    if not static:  # traced with a dynamic batch (torch.export): no launch choice may depend on it
        gemv = False
    if not static or rows_only or torch.compiler.is_compiling():
        one_launch = False      # traced: the grid cannot be checked against residency -> per step
    cfg = markov_config(B if static else EXPORT_ROWS_HINT, V, Rk, dev, one_launch=one_launch,
                        num_programs=num_programs, block_v=block_v, block_r=block_r, num_warps=num_warps,
                        num_stages=num_stages, reduce=reduce, gemv=False if rows_only else gemv,
                        snake=snake, programs_per_sm=programs_per_sm, l2_keep=l2_keep,
                        resident_per_sm=resident_per_sm, pipeline=pipeline, packed=packed)
    if not static:
        cfg["groups"] = triton.cdiv(B, cfg["block_b"])
    block_b, groups, C, one_launch = cfg["block_b"], cfg["groups"], cfg["C"], cfg["one_launch"]
    w1c, w2c = (w1.contiguous(), w2.contiguous()) if Rk else (U, U)   # rank 0 (DFlash): never read
    rowargs = (anchor.contiguous(), w1c, w2c, temperature.contiguous(), seed.contiguous(), start.contiguous())
    tiles = dict(BLOCK_B=block_b, BLOCK_V=cfg["block_v"], BLOCK_R=cfg["block_r"], num_warps=cfg["num_warps"],
                 num_stages=cfg["num_stages"])
    if rows_only:
        launcher(markov_rows_kernel)[(groups,)](U, *rowargs, z, tokens, B, N, V, Rk, U.stride(0), U.stride(1),
                                                **tiles)
        return tokens, z
    hints = cfg["gemv"] and cfg["l2_keep"] > 0
    flags = dict(GEMV=cfg["gemv"], SNAKE=int(bool(cfg["snake"])), L2_HINTS=hints,
                 PIPELINE=bool(cfg["gemv"] and cfg["pipeline"]))
    n_tiles = triton.cdiv(V, cfg["block_v"])
    keep_from = n_tiles - int(cfg["l2_keep"] * n_tiles) if hints else n_tiles   # sweep positions kept in L2
    block_c = max(16, min(pow2(C), 4096 // block_b))             # partials reduced per iteration
    if not one_launch and cfg["reduce"] == "ticket":
        part_val = torch.empty((B, C), dtype=torch.float32, device=dev)
        part_idx = torch.empty((B, C), dtype=torch.int32, device=dev)
        ticket = torch.zeros((N, groups), dtype=torch.int32, device=dev)
        step = launcher(markov_step_kernel)
        for k in range(N):
            step[(C, groups)](U, *rowargs, z, tokens, part_val, part_idx, ticket, B, N, V, Rk, C, k,
                              U.stride(0), U.stride(1), keep_from, BLOCK_C=block_c, **tiles, **flags)
        return tokens, z
    if INTERPRET and one_launch:                # the interpreter runs programs one after another
        C, one_launch = 1, groups == 1
    packed = one_launch and bool(cfg["packed"])
    if packed:                                  # [counter, slots [N, B16]]: one zeroed buffer, no partials
        ws = torch.zeros(SLOTS_OFFSET + N * triton.cdiv(B, 16) * 16, dtype=torch.int64, device=dev)
        counter, slots = ws[:1], ws[SLOTS_OFFSET:]
        part_val = part_idx = slots             # unused
    else:
        part_val = torch.empty((N, B, C), dtype=torch.float32, device=dev)
        part_idx = torch.empty((N, B, C), dtype=torch.int32, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev) if one_launch else part_idx   # unused per step
        slots = part_idx                        # unused
    head = (U, *rowargs, z, tokens, part_val, part_idx, counter, slots, B, N, V, Rk)   # then C and the step range
    kernel = launcher(markov_sample_kernel)
    meta = dict(BLOCK_C=block_c, PACKED=packed, **tiles, **flags)
    strides = (U.stride(0), U.stride(1), keep_from)
    if one_launch:
        meta1 = dict(GRID_SYNC=True, WRITE_LAST=True, **meta)
        if dev.type == "cuda":                  # never a grid that cannot all be resident
            C = _resident_c(head, C, groups, dev, N, strides, meta1)
        kernel[(C, groups)](*head, C, 0, N, *strides, **meta1)
        return tokens, z
    for k in range(N):                          # reduce="prologue"
        kernel[(C, groups)](*head, C, k, k + 1, *strides, GRID_SYNC=False, WRITE_LAST=False, **meta)
    kernel[(1, groups)](*head, C, N, N, *strides, GRID_SYNC=False, WRITE_LAST=True, **meta)
    return tokens, z
