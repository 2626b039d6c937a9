"""Time candidate launch configurations of the dspark Triton kernels on a CUDA GPU.

For each op (rejection_sample, markov_sample exact, block_attention, sparse_mla_attention) and each
issue-target shape, every candidate config (keyword arguments of the op's ``*_triton`` launcher;
``{}`` is the current default) is checked against the PyTorch reference (tokens and accepted counts
exact; float outputs within a stated tolerance) and timed like ``benchmarks/plugins.py`` does
(its helpers: plain median, CUDA-graph replay warm and with L2 flushed; ``bw_frac`` = bytes /
cold graph time / 4.8 TB/s). A config that fails to compile or launch is recorded with its error.
Writes tune-plugins-<gpu>-<sha>.json (or into --out) with every measurement and, per shape, the
fastest correct config. Defaults live in one dict per op: REJECTION_DEFAULTS (kernels/rejection.py),
MARKOV_DEFAULTS (kernels/markov_launch.py), ATTN_DEFAULTS (kernels/block_attention.py), MLA_DEFAULTS
(kernels/sparse_mla.py). About 3-4 minutes on one H200 (``--ops attn`` alone: about 2; it ends
with a table of every block_attention config's bandwidth fraction at every shape).

    python benchmarks/tune_plugins.py [--out DIR] [--ops reject,markov,attn,mla]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.plugins import (DEV, PEAK, attention_case, err, graph_time, markov_bytes, markov_inputs,  # noqa: E402
                                mla_case, rejection_case, timeit)
from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.block_attention import block_attention_ref  # noqa: E402
from dspark_trt.plugins.kernels import block_attention as kba, markov_launch as kmk  # noqa: E402
from dspark_trt.plugins.kernels import rejection as krj, sparse_mla as ksm  # noqa: E402
from dspark_trt.plugins.markov_sample import markov_sample_ref  # noqa: E402
from dspark_trt.plugins.rejection_sample import rejection_sample_ref  # noqa: E402
from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_ref  # noqa: E402

ATOL_BF16 = 2e-2          # bf16 attention outputs (bf16 P in P @ V), as in tests/plugins/test_plugins_gpu.py
ATOL_Z = 1e-3             # Markov z: fp32 sums of bf16 products in a different order

REJECTION_CONFIGS = [
    {}, {"schedule": "row"},
    {"block_v": 1024, "num_warps": 4}, {"block_v": 1024, "num_warps": 8}, {"block_v": 4096, "num_warps": 8},
    {"programs_per_sm": 4}, {"programs_per_sm": 16}, {"max_tiles": 2}, {"max_tiles": 32},
]
# {"num_programs": ...}: the per-step grid of the pre-tuning rule (floor instead of ceil), for comparison
MARKOV_B1 = [
    {"one_launch": False}, {"one_launch": False, "num_programs": 594}, {"one_launch": True},
    {"one_launch": False, "reduce": "prologue"},
    {"one_launch": False, "reduce": "prologue", "snake": True},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 3},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 2},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "block_v": 16, "num_warps": 4,
     "programs_per_sm": 6},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 3, "l2_keep": 0.4},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 3, "l2_keep": 0.6},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "programs_per_sm": 3},
    {"one_launch": False, "reduce": "ticket", "gemv": True, "snake": True, "programs_per_sm": 3},
    {"one_launch": True, "gemv": True, "snake": True},
    {"one_launch": True, "gemv": True, "snake": True, "block_v": 16, "num_warps": 4, "resident_per_sm": 6,
     "pipeline": True},
]
MARKOV_B64 = [
    {"one_launch": False}, {"one_launch": False, "num_programs": 594}, {"one_launch": True},
    {"one_launch": False, "snake": True},
    {"one_launch": True, "snake": True}, {"one_launch": False, "reduce": "prologue", "snake": True},
    # the one-launch tensor-core body's tile and residency (session 38: 0.7 ms of a batch-64 round)
    {"one_launch": True, "resident_per_sm": 2}, {"one_launch": True, "resident_per_sm": 2, "num_warps": 4},
    {"one_launch": True, "resident_per_sm": 3, "num_warps": 4}, {"one_launch": True, "block_v": 64},
    {"one_launch": True, "block_v": 64, "resident_per_sm": 2}, {"one_launch": True, "block_r": 128},
    {"one_launch": True, "block_r": 32, "num_stages": 4}, {"one_launch": True, "num_stages": 2},
    {"one_launch": False, "programs_per_sm": 2}, {"one_launch": False, "programs_per_sm": 8},
]
MARKOV_R512 = [
    {"one_launch": False}, {"one_launch": False, "num_programs": 1010}, {"one_launch": True},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 3},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 4},
    {"one_launch": False, "reduce": "prologue", "gemv": True, "snake": True, "programs_per_sm": 3, "l2_keep": 0.4},
]
# block_attention: {} and {"num_splits": 2} are the pre-prefetch default and best (plugins-*-de0d854).
# prefetch=True lets Triton keep num_stages - 1 K/V tiles in flight; programs_per_sm states the
# occupancy of that tile (ptxas sm_90: bn64 ns3 nw4 198 regs / 76 KB smem -> 2; bn32 ns4 128 regs /
# 58 KB -> 3; bn128 ns3 nw8 144 KB -> 1) so that default_num_splits sizes the waves right.
_PF = {"prefetch": True}
ATTN_CONFIGS = [
    {}, {"num_splits": 2}, {"kvh_first": True},
    {**_PF, "num_stages": 3, "programs_per_sm": 2},
    {**_PF, "num_stages": 3, "programs_per_sm": 2, "kvh_first": True},
    {**_PF, "num_stages": 3, "num_warps": 8, "programs_per_sm": 2},
    {**_PF, "num_stages": 3, "num_warps": 8, "programs_per_sm": 2, "kvh_first": True},
    {**_PF, "num_stages": 3, "num_splits": 2},
    {**_PF, "num_stages": 4, "programs_per_sm": 2},
    {**_PF, "num_stages": 4, "num_warps": 8, "programs_per_sm": 2},
    {**_PF, "block_n": 32, "num_stages": 4, "programs_per_sm": 3},
    {**_PF, "block_n": 32, "num_stages": 4, "num_splits": 1},
    {**_PF, "block_n": 32, "num_stages": 5, "programs_per_sm": 3},
    {**_PF, "block_n": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1},
]
ATTN_B1 = [{"num_splits": 16}, {**_PF, "num_stages": 3, "num_splits": 16}, {**_PF, "num_stages": 3, "num_splits": 64}]
# (B, context, page size): the targets (page 16 as in benchmarks/plugins.py) and the
# runtime's default page size 64
ATTN_SHAPES = [(64, 4096, 16), (64, 1024, 16), (1, 4096, 16), (64, 4096, 64)]
# sparse MLA: {} is the default (64 heads x 512 dims, 64-entry tiles, 8 warps, wgmma; 16 heads and 4
# warps for few tokens); the rest are measured against it. _MLA32 is the default before session 55 (32
# heads x 32 entries; 4 warps for whole lists, mma.sync; lists split below one wave of programs), the
# base of the configs tried then.
_MLA32 = {"block_h": 32, "block_n": 32, "programs_per_sm": 1}
MLA_CONFIGS = [
    # {"block_h": 64, "num_splits": 1}: 64-head tiles over whole lists at any batch, as an engine's export
    # (dynamic shapes) launches them; "programs_per_sm": 1: the split rule before session 55
    {}, {"block_h": 64, "num_splits": 1}, {"block_h": 64, "programs_per_sm": 1}, {"block_n": 32},
    {"prefetch": False}, {"num_stages": 1}, {"group": 2, "block_h": 32},
    {"group": 2, "block_h": 32, "num_stages": 1},
    # few tokens (session 55, H100, batch 1: 16 heads x 32 entries over whole lists 12.7 us against the
    # default's 15.7 split and 18.3 whole): narrower head tiles over whole lists
    {"block_h": 16, "block_n": 64, "num_splits": 1}, {"block_h": 32, "block_n": 32, "num_splits": 1},
    *({**_MLA32, **c} for c in [
        {}, {"num_stages": 3}, {"block_n": 16}, {"block_n": 16, "num_stages": 3}, {"block_h": 16},
        {"block_h": 16, "num_splits": 1}, {"num_warps": 8}, {"block_h": 64, "block_dv": 256, "num_warps": 4},
        {"prefetch": False}, {"programs_per_sm": 2},
        # 64-row MMAs compile to Hopper's wgmma (32-row ones to mma.sync); sm_90 compiles on the CPU
        # (benchmarks/mla_resources.py, mla-resources-sm90-5594253.json): 64 x 512 with 8 warps spills
        # (255 registers + 128 B of stack), 64 x 256 with 8 warps takes 206-208 registers and 64 x 128
        # with 4 213-221, no stack. 64 heads, or G tokens of one block per program (their lists are
        # equal) x block_h heads
        {"block_h": 64, "block_dv": 256, "num_warps": 8}, {"block_h": 64, "block_dv": 128, "num_warps": 4},
        {"group": 2, "num_warps": 8}, {"group": 2, "block_dv": 256, "num_warps": 8},
        {"group": 2, "block_dv": 128, "num_warps": 4},
        {"group": 4, "block_h": 16, "block_dv": 256, "num_warps": 8},
        {"group": 8, "block_h": 8, "block_dv": 256, "num_warps": 8},
        {"group": 2, "num_warps": 8, "num_stages": 3},
    ]),
]


def measure(fn, check, nbytes) -> dict:
    """Correctness first (a wrong config is not timed), then plain and graph-replay times."""
    try:
        parity = check(fn())
        if not parity.pop("ok"):
            return dict(ok=False, **parity)
        plain = timeit(fn)
        warm, cold = graph_time(fn, plain)
    except Exception as e:                                   # noqa: BLE001 (compile / launch errors)
        torch.cuda.synchronize()
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[:500],
                    where=traceback.format_exc(limit=3)[-800:])
    return dict(ok=True, kernel_us=plain * 1e6, graph_us=warm * 1e6, graph_cold_us=cold * 1e6,
                bw_frac=nbytes / cold / PEAK, **parity)


def sweep(results, op, shape, nbytes, configs, run, check):
    """Measure every config of one (op, shape); keep the fastest correct one."""
    entries = []
    for cfg in configs:
        r = measure(lambda: run(cfg), check, nbytes)
        entries.append(dict(config=cfg, **r))
        t = f"{r['graph_cold_us']:9.1f} us {r['bw_frac'] * 100:5.1f}%" if r["ok"] else \
            f"FAILED {r.get('error', {k: v for k, v in r.items() if k != 'ok'})}"
        print(f"{op:22s} {shape:30s} {json.dumps(cfg):100s} {t}", flush=True)
    good = [e for e in entries if e["ok"]]
    best = min(good, key=lambda e: e["graph_cold_us"]) if good else None
    results.setdefault(op, {})[shape] = dict(bytes=nbytes, configs=entries, default=entries[0],
                                             best=best and {k: best[k] for k in ("config", "graph_cold_us", "bw_frac")})
    if best:
        gain = entries[0]["graph_cold_us"] / best["graph_cold_us"] if entries[0]["ok"] else float("nan")
        print(f"  -> best {json.dumps(best['config'])}: {best['graph_cold_us']:.1f} us "
              f"({best['bw_frac'] * 100:.1f}% of peak), {gain:.2f}x the default", flush=True)


def tune_rejection(results):
    for B in (1, 64):
        args, nbytes = rejection_case(B)
        ra, rn = rejection_sample_ref(*args)
        check = lambda out: dict(ok=bool(torch.equal(out[0], ra) and torch.equal(out[1], rn)))
        sweep(results, "rejection_sample", f"B={B} N=7 V=151936 fp32", nbytes, REJECTION_CONFIGS,
              lambda cfg: krj.rejection_sample_triton(*args, **cfg), check)


def tune_markov(results, only=None):
    """``only``: the cases to run, as "B" or "Bg" (every row greedy), e.g. {"64g", "32g"}; None: all."""
    cases = ((1, 151936, 256, MARKOV_B1, False), (64, 151936, 256, MARKOV_B64, False),
             (64, 151936, 256, MARKOV_B64, True), (32, 151936, 256, MARKOV_B64, True),
             (1, 129280, 512, MARKOV_R512, False))
    for B, V, r, configs, greedy in cases:
        if only is not None and f"{B}{'g' if greedy else ''}" not in only:
            continue
        args = markov_inputs(B, 7, V, r, greedy=greedy)
        rt, rz = markov_sample_ref(*args)

        def check(out, rt=rt, rz=rz):
            e = err(out[1], rz)
            return dict(ok=bool(torch.equal(out[0], rt)) and e < ATOL_Z, z_max_err=e)
        shape = f"B={B} N=7 V={V} r={r}" + (" greedy" if greedy else "")
        sweep(results, "markov_sample", shape, markov_bytes(B, 7, V, r), configs,
              lambda cfg: kmk.markov_sample_triton(*args, **cfg), check)


def attn_splits(cfg, B, ctx, page, T=8, Hkv=8) -> int:
    """The split count block_attention_triton resolves for ``cfg`` (recorded with its time)."""
    if cfg.get("num_splits"):
        return cfg["num_splits"]
    keys = (triton.cdiv(ctx + T, page) + 1) * page                  # block table as benchmarks.plugins.paged builds it
    return kba.default_num_splits(torch.device(DEV), B * Hkv, keys,  # T=8, G=4: one query tile per (row, KV head)
                                  cfg.get("block_n", kba.ATTN_DEFAULTS["block_n"]),
                                  cfg.get("programs_per_sm", kba.ATTN_DEFAULTS["programs_per_sm"]))


def tune_block_attention(results):
    for B, ctx, page in ATTN_SHAPES:
        args, nbytes = attention_case(B, ctx, page=page)
        ref = block_attention_ref(*args)
        configs = ATTN_CONFIGS + (ATTN_B1 if B == 1 else [])

        def check(out, ref=ref):
            e = err(out, ref)
            return dict(ok=e < ATOL_BF16, max_err=e)
        shape = f"B={B} ctx={ctx} T=8 H=32/8x128" + ("" if page == 16 else f" page={page}")
        sweep(results, "block_attention", shape, nbytes, configs,
              lambda cfg: kba.block_attention_triton(*args, **cfg), check)
        for e in results["block_attention"][shape]["configs"]:
            e["num_splits"] = attn_splits(e["config"], B, ctx, page)
        del ref, args
        torch.cuda.empty_cache()
    attn_summary(results["block_attention"])


def attn_summary(shapes: dict):
    """One line per config: bandwidth fraction at every shape (the default is picked from this)."""
    names = list(shapes)
    cfgs = {json.dumps(e["config"]): None for s in names for e in shapes[s]["configs"]}
    print("block_attention bw_frac (num_splits) per shape: " + " | ".join(names))
    for c in cfgs:
        cells = []
        for s in names:
            e = next((e for e in shapes[s]["configs"] if json.dumps(e["config"]) == c), None)
            cells.append(f"{'-':>10s}" if e is None else f"{e['bw_frac'] * 100:5.1f}% ({e['num_splits']:2d})"
                         if e["ok"] else f"{'FAILED':>10s}")
        print(f"  {c:100s} " + " ".join(cells), flush=True)


def tune_sparse_mla(results, only=None, batches=(64, 1)):
    """``only``: besides the default, the configs whose JSON contains one of these texts (``|``
    between them; None: all). ``batches``: batch rows of 8 tokens each."""
    configs = [c for c in MLA_CONFIGS if not c or only is None or any(o in json.dumps(c) for o in only.split("|"))]
    for B in batches:
        args, nbytes = mla_case(B)
        ref = sparse_mla_attention_ref(*args)

        def check(out, ref=ref):
            e = err(out, ref)
            return dict(ok=e < ATOL_BF16, max_err=e)
        sweep(results, "sparse_mla_attention", f"B={B} N=8 H=128 D=512 W={args[2].shape[1]}", nbytes,
              configs, lambda cfg: ksm.sparse_mla_attention_triton(*args, **cfg), check)
        del ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--ops", default="reject,markov,attn,mla", help="comma list: reject,markov,attn,mla")
    ap.add_argument("--markov-cases", default=None,
                    help='comma list of the markov cases to run, "B" or "Bg" (every row greedy): 1,64,64g,32g')
    ap.add_argument("--mla-only", default=None,
                    help="sparse MLA: the default and the configs whose JSON contains one of these texts "
                         "('|' between them), e.g. group")
    ap.add_argument("--mla-batches", default="64,1", help="sparse MLA: batch rows of 8 tokens, comma list")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tune_plugins.py needs a CUDA GPU")
    torch.manual_seed(0)
    ops = set(a.ops.split(","))
    unknown = ops - {"reject", "markov", "attn", "mla"}
    if unknown:
        sys.exit(f"unknown --ops {sorted(unknown)}")
    t0 = time.time()
    results: dict = {}
    gpu, sha = torch.cuda.get_device_name(), provenance.git_sha()
    path = Path(a.out) / f"tune-plugins-{gpu.replace(' ', '_')}-{sha}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    only = set(a.markov_cases.split(",")) if a.markov_cases else None
    markov = lambda results: tune_markov(results, only)  # noqa: E731
    mla = lambda results: tune_sparse_mla(results, a.mla_only, [int(b) for b in a.mla_batches.split(",")])  # noqa: E731
    for name, fn in (("reject", tune_rejection), ("markov", markov), ("attn", tune_block_attention),
                     ("mla", mla)):
        if name in ops:
            fn(results)
            torch.cuda.empty_cache()
            doc = dict(git_sha=sha, gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                       peak_bytes_per_s=PEAK, command=" ".join([sys.executable] + sys.argv),
                       seconds=time.time() - t0, ops=results)
            path.write_text(json.dumps(doc, indent=1))            # after every op: a cut run keeps its part
            print(f"[tune] {name} done; wrote {path} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
