"""Benchmark the dspark Triton kernels against their PyTorch references on a CUDA GPU.

Real shapes: Qwen3-8B block attention (GQA 32/8 x 128, verify block of 8, context 1024/4096),
DeepSeek-V4-Pro sparse MLA (128 heads, latent 512, window 128 + block of 8 -> 256 indices), the
Markov sampler (V=151936 r=256 and V=129280 r=512, N=7) in every schedule, rejection sampling
(V=151936, N=7), KV-cache writes and SWA index lists; batch 1..64. Per case: median time of a plain
kernel call and of the reference (CUDA events after warm-up; includes Python/launch overhead), the
kernel replayed in a CUDA graph as the runtime runs it (``graph_us``: R back-to-back replays;
``graph_cold_us``: replays of [256 MB L2 flush + kernel] minus replays of the flush alone, i.e. with
its inputs evicted from the 50 MB L2 as in a real decode step), bytes moved (compulsory HBM traffic,
stated per op), achieved bandwidth as a fraction of the H200's 4.8 TB/s (``bw_frac`` from
``graph_cold_us``; ``bw_frac_plain`` from the plain call), and parity (max abs error or exact token
equality). Writes benchmarks/results/plugins-<gpu>-<sha>.json (or --out DIR) and prints a table.
The timing helpers and the ``*_case`` input builders are shared with ``benchmarks/tune_plugins.py``.

    python benchmarks/plugins.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

import dspark_trt.plugins  # noqa: E402,F401
from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.block_attention import block_attention_ref  # noqa: E402
from dspark_trt.plugins.kernels import block_attention as kba, kv_cache as kkv, markov_launch as kmk, markov_topk as kmt  # noqa: E402
from dspark_trt.plugins.kernels import rejection as krj, sparse_mla as ksm, swa_indices as ksw  # noqa: E402
from dspark_trt.plugins.kv_cache import kv_cache_write_ref  # noqa: E402
from dspark_trt.plugins.markov_sample import markov_sample_ref, markov_sample_topk_ref  # noqa: E402
from dspark_trt.plugins.noncausal_swa_indices import index_width, noncausal_swa_indices_ref  # noqa: E402
from dspark_trt.commands.bench import time_ms  # noqa: E402
from dspark_trt.plugins.rejection_sample import rejection_sample_ref  # noqa: E402
from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_ref  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

PEAK = hbm_bytes_per_s()     # the GPU's own peak HBM rate (devices.HBM_BYTES_PER_S; without a GPU the H200's 4.8e12)
PEAK_FLOPS = 790e12          # H200 bf16 tensor limit this project compares against (datasheet: 989e12 dense)
DEV = "cuda"
BF16 = torch.bfloat16


def timeit(fn, warmup=3, reps=10) -> float:
    """Median seconds per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return sorted(ts)[len(ts) // 2]


_FLUSH: list[torch.Tensor] = []


def replay_seconds(launch, reps: int) -> float:
    """Median over 3 batches of ``reps`` back-to-back ``launch()`` calls (``dspark-trt bench``'s
    CUDA-event timer, each batch after one warm-up call): seconds per call."""
    return sorted(time_ms(launch, reps, cuda=True) for _ in range(3))[1] / 1e3


def graph_time(fn, plain_s: float) -> tuple[float, float]:
    """(warm, cold) seconds per call of ``fn`` replayed in a CUDA graph (see the module doc)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device=DEV))
    flush = _FLUSH[0]
    reps = max(3, min(50, int(0.05 / max(plain_s, 1e-6))))
    graphs = []
    for body in (lambda: fn(), lambda: (flush.zero_(), fn()), lambda: flush.zero_()):
        body()                                            # compile / allocate outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
        torch.cuda.synchronize()
        graphs.append(g)

    warm, flush_and_fn, flush_only = (replay_seconds(g.replay, reps) for g in graphs)
    del graphs
    return warm, max(flush_and_fn - flush_only, 1e-9)


def err(a, b) -> float:
    a, b = a.float(), b.float()
    same_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return float(torch.where(same_inf, 0.0, (a - b).abs()).max())


def record(rows, op, shape, fn, ref_s, nbytes, flops=None, **parity):
    """Time ``fn`` plainly and in CUDA graphs, append a row and print it; with ``flops`` also the
    fraction of the bf16 tensor peak and the time the bytes / the flops need at peak."""
    kernel_s = timeit(fn)
    warm_s, cold_s = graph_time(fn, kernel_s)
    compute = {} if flops is None else dict(flops=flops, tflops_frac=flops / cold_s / PEAK_FLOPS,
                                            hbm_bound_us=nbytes / PEAK * 1e6, compute_bound_us=flops / PEAK_FLOPS * 1e6)
    rows.append(dict(op=op, shape=shape, kernel_us=kernel_s * 1e6, graph_us=warm_s * 1e6,
                     graph_cold_us=cold_s * 1e6, ref_us=ref_s * 1e6 if ref_s else None, bytes=nbytes,
                     bw_frac=nbytes / cold_s / PEAK, bw_frac_plain=nbytes / kernel_s / PEAK, **compute, **parity))
    r = rows[-1]
    ref = f"{r['ref_us']:9.1f}" if r["ref_us"] else "        -"
    par = " ".join(f"{k}={v}" for k, v in parity.items())
    print(f"{op:28s} {shape:40s} {r['kernel_us']:9.1f} {r['graph_us']:8.1f} {r['graph_cold_us']:8.1f} {ref} "
          f"{r['bw_frac']*100:6.1f}%  {par}", flush=True)


def paged(B, ctx, Hkv, D, page=16, extra=1):
    pages = -(-ctx // page) + extra
    table = torch.arange(B * pages, device=DEV).view(B, pages)
    table = table[:, torch.randperm(pages, device=DEV)]
    kc = torch.randn(B * pages + 1, page, Hkv, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    return kc, vc, table


def attention_case(B, ctx, T=8, H=32, Hkv=8, D=128, page=16):
    """Qwen3-8B verify block (DSpark non-causal: every query sees ctx + T keys) -> (args of
    block_attention_triton, bytes: K and V of every key once, q read, o written)."""
    kc, vc, table = paged(B, ctx + T, Hkv, D, page)
    q = torch.randn(B, T, H, D, device=DEV, dtype=BF16)
    pos = (ctx + torch.arange(T, device=DEV)).expand(B, T).contiguous()
    lim = torch.full_like(pos, ctx + T - 1)
    return (q, kc, vc, table, pos, lim, D ** -0.5), B * (ctx + T) * Hkv * D * 2 * 2 + 2 * q.numel() * 2


def bench_block_attention(rows, batches, contexts):
    for ctx in contexts:
        for B in batches:
            args, nbytes = attention_case(B, ctx)
            f = lambda: kba.block_attention_triton(*args)
            g = lambda: block_attention_ref(*args)
            small = B * ctx <= 16 * 4096
            record(rows, "block_attention", f"B={B} ctx={ctx} T=8 H=32/8x128", f, timeit(g, 1, 3) if small else None,
                   nbytes, max_err=err(f(), g()) if small else None)


def mla_flops(B, H=128, D=512, N=8, width=256) -> int:
    """QK^T and PV over every index slot (padded width): 2 * 2 * width * D per query head."""
    return 4 * B * N * H * width * D


def mla_case(B, H=128, D=512, N=8, Wn=128, page=64, ctx=1000):
    """DeepSeek-V4-Pro sparse MLA of a verify block (window Wn + block N, padded index width)
    -> (args of sparse_mla_attention_triton, bytes: gathered rows once per batch row, q, o, indices)."""
    width = index_width(Wn, N)
    start = torch.full((B,), ctx, device=DEV)
    pages = -(-(ctx + N) // page) + 1
    table = torch.arange(B * pages, device=DEV).view(B, pages)
    idx, _ = noncausal_swa_indices_ref(start, table, N, page, Wn, width)
    kv = torch.randn(B * pages * page, D, device=DEV, dtype=BF16)
    q = torch.randn(B * N, H, D, device=DEV, dtype=BF16)
    sink = torch.randn(H, device=DEV)
    idx = idx.view(B * N, width)
    nbytes = B * (Wn + N) * D * 2 + 2 * q.numel() * 2 + idx.numel() * 4
    return (q, kv, idx, sink, D ** -0.5, D), nbytes


def bench_sparse_mla(rows, batches):
    for B in batches:
        args, nbytes = mla_case(B)
        f = lambda: ksm.sparse_mla_attention_triton(*args)
        g = lambda: sparse_mla_attention_ref(*args)
        record(rows, "sparse_mla_attention", f"B={B} N=8 H=128 D=512 W={args[2].shape[1]}", f, timeit(g, 1, 3),
               nbytes, flops=mla_flops(B, width=args[2].shape[1]), max_err=err(f(), g()))


def markov_bytes(B, N, V, r):
    """W2 once per step + U read + z written."""
    return N * V * r * 2 + B * N * V * (2 + 4)


def markov_inputs(B, N, V, r, greedy=False):
    """Rows alternate greedy / T = 0.8 (every row greedy with ``greedy``, the serving default)."""
    U = torch.randn(B, N, V, device=DEV, dtype=BF16) * 3
    w1 = torch.randn(V, r, device=DEV, dtype=BF16) * 0.1
    w2 = torch.randn(V, r, device=DEV, dtype=BF16) * 0.1
    anchor = torch.randint(0, V, (B,), device=DEV)
    temp = torch.where((torch.arange(B, device=DEV) % 2 == 0) | greedy, 0.0, 0.8)
    seed = torch.arange(B, device=DEV) + 1234
    start = torch.full((B,), 500, device=DEV)
    return U, anchor, w1, w2, temp, seed, start


def bench_markov(rows, batches, shapes, N=7):
    for V, r in shapes:
        for B in batches:
            args = markov_inputs(B, N, V, r)
            rt, rz = markov_sample_ref(*args)
            ref_s = timeit(lambda: markov_sample_ref(*args), 1, 3)
            nbytes = markov_bytes(B, N, V, r)
            scheds = {"default": {}, "one_launch": dict(one_launch=True), "per_step": dict(one_launch=False)}
            if B == 1:
                scheds["rows (trt aot)"] = dict(rows_only=True)
            for name, kw in scheds.items():
                f = lambda: kmk.markov_sample_triton(*args, **kw)
                t, z = f()
                record(rows, f"markov_sample[{name}]", f"B={B} N={N} V={V} r={r}", f, ref_s, nbytes,
                       tokens_equal=bool(torch.equal(t, rt)), token_mismatches=int((t != rt).sum()),
                       z_max_err=err(z, rz))
            f = lambda: kmt.markov_sample_topk_triton(*args, 4096, 4)
            t, z = f()
            tt, tz = markov_sample_topk_ref(*args, 4096, 4)
            nbytes_fast = B * N * V * (2 + 4) + B * N * (-(-V // 4096) * 4) * r * 2
            record(rows, "markov_sample_topk[fast]", f"B={B} N={N} V={V} r={r}", f,
                   timeit(lambda: markov_sample_topk_ref(*args, 4096, 4), 1, 3), nbytes_fast,
                   tokens_equal=bool(torch.equal(t, tt)), z_max_err=err(z, tz),
                   agree_with_exact=float((t == rt).float().mean()))


def rejection_case(B, V=151936, N=7):
    """Verify a block of N drafts, greedy and sampled rows alternating -> (args, bytes: every
    target and draft row read once)."""
    L = torch.randn(B, N + 1, V, device=DEV) * 3
    z = L[:, :N] + torch.randn(B, N, V, device=DEV) * 0.3
    drafts = z.argmax(-1)
    temp = torch.where(torch.arange(B, device=DEV) % 2 == 0, 0.0, 1.0)
    seed = torch.arange(B, device=DEV)
    start = torch.full((B,), 100, device=DEV)
    return (L, drafts, z, temp, seed, start), (L.numel() + z.numel()) * 4


def bench_rejection(rows, batches, V=151936, N=7):
    for B in batches:
        args, nbytes = rejection_case(B, V, N)
        f = lambda: krj.rejection_sample_triton(*args)
        g = lambda: rejection_sample_ref(*args)
        (a, n), (ra, rn) = f(), g()
        record(rows, "rejection_sample", f"B={B} N={N} V={V} fp32", f, timeit(g, 1, 3), nbytes,
               tokens_equal=bool(torch.equal(a, ra) and torch.equal(n, rn)))


def bench_small_ops(rows, batches):
    for B in batches:
        Hkv, D, T = 8, 128, 8
        kc, vc, table = paged(B, 2048, Hkv, D)
        k = torch.randn(B, T, Hkv, D, device=DEV, dtype=BF16)
        v = torch.randn_like(k)
        pos = (2000 + torch.arange(T, device=DEV)).expand(B, T).contiguous()
        f = lambda: kkv.kv_cache_write_triton(kc, vc, k, v, table, pos)
        kr, vr = kc.clone(), vc.clone()
        kv_cache_write_ref(kr, vr, k, v, table, pos)
        f()
        record(rows, "kv_cache_write", f"B={B} T={T} Hkv=8 D=128", f,
               timeit(lambda: kv_cache_write_ref(kc, vc, k, v, table, pos), 1, 3), 4 * k.numel() * 2,
               max_err=max(err(kc[:-1], kr[:-1]), err(vc[:-1], vr[:-1])))
        start = torch.full((B,), 1000, device=DEV)
        args = (start, table, 8, 16, 128, 256)
        (i, n), (ri, rn) = ksw.noncausal_swa_indices_triton(*args), noncausal_swa_indices_ref(*args)
        record(rows, "noncausal_swa_indices", f"B={B} N=8 W=128 width=256",
               lambda: ksw.noncausal_swa_indices_triton(*args),
               timeit(lambda: noncausal_swa_indices_ref(*args), 1, 3), i.numel() * 4,
               tokens_equal=bool(torch.equal(i, ri) and torch.equal(n, rn)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64 only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", default="", help="comma list: attn,mla,markov,reject,small")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/plugins.py needs a CUDA GPU")
    torch.manual_seed(0)
    batches = [1, 64] if a.quick else [1, 8, 64]
    only = set(a.only.split(",")) if a.only else {"attn", "mla", "markov", "reject", "small"}
    rows = []
    t0 = time.time()
    print(f"{'op':28s} {'shape':40s} {'plain_us':>9s} {'graph':>8s} {'cold':>8s} {'ref_us':>9s} {'HBM%':>7s}  parity"
          "   (HBM% from the cold graph time)")
    if "markov" in only:
        bench_markov(rows, batches, [(151936, 256), (129280, 512)])
    if "attn" in only:
        bench_block_attention(rows, batches, [1024, 4096])
    if "mla" in only:
        bench_sparse_mla(rows, batches)
    if "reject" in only:
        bench_rejection(rows, batches)
    if "small" in only:
        bench_small_ops(rows, batches)
    gpu = torch.cuda.get_device_name()
    sha = provenance.git_sha()
    result = dict(git_sha=sha, gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  peak_bytes_per_s=PEAK, command=" ".join([sys.executable] + sys.argv),
                  seconds=time.time() - t0, rows=rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"plugins-{gpu.replace(' ', '_')}-{sha}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
