"""``dspark-trt bench``: decode-step latencies, end-to-end tokens/s, tau, roofline, HF peer.

For each batch size B (default 1..64): step latencies from the replayed CUDA graphs at a context of
``--prompt-len`` tokens (target autoregressive step, draft step, verify step, target forward alone
for 1 and N+1 tokens, Markov sampler alone), then end-to-end greedy decoding of B random prompts
with speculative decoding and autoregressively (decode throughput, prefill excluded; round wall
time; host overhead = 1 - GPU step time / round wall time; mean tau). The HBM roofline of a step is
(weights read + KV read) / ``--hbm-tbps``; ``sweep`` in the JSON lists, per batch size, each step
against its roofline (efficiency = roofline / measured) next to the compiled HF peer where it ran,
and ``<json stem>.png`` plots it (``benchmarks/plot_bench.py``). The HF transformers peer decodes
the same prompts with the same weights (``benchmarks/hf_peer.py``; on the engine path from the
engine directory's weights), or is skipped with the reason in ``hf_peer.skipped``. ``--compile``
(``LLM(compile=...)``) and ``--unfused`` (the HF linears, not the engines' fused projections) pick
the eager path. Speedups at the paper's tau are labelled projections. JSON goes to
``<out-dir>/bench-<gpu>-<git sha>.json``. On CPU it runs eagerly (a smoke test).
"""
from __future__ import annotations

from .. import provenance

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .common import add_model_args, add_source_args, load_llm
from ..checkpoints.files import cost_file
from ..checkpoints.fp8 import has_fp8
from ..devices import hbm_bytes_per_s
from ..progress import bar

REPO = Path(__file__).resolve().parents[2]
TARGETS = {  # name -> (metric key, bound, "le"/"ge"); all at batch 1
    "ar_step_ge_85pct_of_hbm_roofline": ("ar_roofline_efficiency", 0.85, "ge"),
    "verify_step_le_1.15x_ar_step": ("verify_over_ar", 1.15, "le"),
    "draft_step_le_1ms": ("draft_step_ms", 1.0, "le"),
    "host_overhead_le_5pct_per_round": ("spec_host_overhead", 0.05, "le"),
    "ge_1.5x_hf_plain_decoding_b1": ("speedup_vs_hf", 1.5, "ge"),
    # trained weights only: measured speedup >= 0.8 x tau x AR step / (draft step + verify step)
    "trained_speedup_ge_0.8x_step_model": ("speedup_over_step_model", 0.8, "ge"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the decode loop against the roofline and HF")
    add_model_args(p)
    add_source_args(p, ("random_weights",),
                    random_weights=dict(help="confirm benchmarking a --model preset with random weights"))
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prompts", choices=["random", "heldout"], default="random",
                   help="random token ids, or text cut from the held-out stdlib modules (the "
                        "training corpus of the default pair; needs a tokenizer) for a real tau")
    p.add_argument("--gen-len", type=int, default=128, help="new tokens per request (end to end)")
    p.add_argument("--iters", type=int, default=20, help="replays per step-latency measurement")
    p.add_argument("--hf", default="eager,compiled",
                   help="HF transformers peer modes: eager,compiled (or 'none')")
    p.add_argument("--hf-batch-sizes", default="1")
    p.add_argument("--paper-tau", type=float, default=6.17, help="tau for the projection (Qwen3-8B GSM8K)")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth for the roofline (default: the GPU's own, devices.HBM_BYTES_PER_S; "
                        "4.8, the H200's, elsewhere)")
    p.add_argument("--graph-backend", choices=["cuda-python", "torch"], default=None)
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="decode steps as CUDA graphs (auto: on for one GPU, off under --tp-size)")
    p.add_argument("--time-budget-s", type=float, default=330.0,
                   help="skip remaining batch sizes past this wall time (HF peer gets its reserve)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-modes", default="fixed",
                   help="end-to-end speculative runs per verify mode (fixed,threshold,scheduled; "
                        "the last two need a confidence head): 'speculative_<mode>' in the JSON")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile LLM's eager decoder layers and norms (inductor, or the backend "
                        "named), replayed inside the CUDA graphs; not for --engine")
    p.add_argument("--unfused", action="store_true",
                   help="eager modules with separate q/k/v and gate/up linears (the HF layout) instead "
                        "of the engines' fused projections (A/B of the fusion)")
    p.add_argument("--plot", choices=["on", "off"], default="on",
                   help="write <json stem>.png of the batch sweep beside the JSON (needs matplotlib)")
    p.add_argument("--cost-curve", action="store_true",
                   help="only measure the verify cost curve (verify-step latency vs total verified "
                        "tokens, for --batch-sizes x widths 1..N+1) of the confidence scheduler and "
                        "write verify_cost.json (to --cost-curve-out)")
    p.add_argument("--cost-curve-out", default=None,
                   help="directory for verify_cost.json (with --draft-vocab: verify_cost.vocab-<size>-<hash>.json; "
                        "default: the draft checkpoint or engine directory)")
    p.set_defaults(func=run)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: expected comma-separated integers, got '{s}'") from None


# ---- timing ---------------------------------------------------------------------------------------

HOST_ITERS = 5       # the host overhead's iterations at least (a difference of walls: noisy)
CPU_STEP_ITERS = 5   # on the CPU, the step latencies' samples at least: a median of 2 is their mean, and
                     # one stretched call priced the 1-row AR step at 20 ms against 12.6 ms as it ran,
                     # which turned the scheduled mode speculative at batch 1 (session 31, 53b30e8)


def _wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_ms(fn, iters: int, cuda: bool) -> float:
    """Time of ``fn()`` after one warm-up: on the CPU the median wall of ``iters`` calls (a shared
    machine's other jobs stretch single calls), on the GPU the CUDA-event mean of ``iters``
    back-to-back calls."""
    fn()
    if not cuda:
        return float(np.median([_wall_ms(fn) for _ in range(max(1, iters))]))
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def host_overhead_ms(round_fn, step_fns, step_ms: list[float], iters: int, cuda: bool) -> float:
    """What ``round_fn`` (a round called from the host) costs beyond its device steps
    ``step_fns``, at least 0: on the GPU the median wall of ``iters`` rounds (each reads its
    results back, so ends synchronised) less the steps' event times (already measured
    ``step_ms``; an event mean over 10 rounds had read 0.27 ms at batch 1 where the steady load's
    rounds spent 0.12 outside their steps, H100, session 40); on the CPU the median over at least
    ``HOST_ITERS`` iterations of the round's wall minus its steps' walls, all timed in the same
    iteration (the machine's drift cancels; a difference of separately timed means did not: 8.8 ms
    at 4 rows against 0.6 at 1 and 0 at 16 on the 2-core CPU, d1a7e3d)."""
    if cuda:
        round_fn()
        torch.cuda.synchronize()
        walls = [_wall_ms(round_fn) for _ in range(max(iters, HOST_ITERS))]
        return max(0.0, float(np.median(walls)) - sum(step_ms))
    for f in (round_fn, *step_fns):
        f()
    diffs = [_wall_ms(round_fn) - sum(_wall_ms(f) for f in step_fns) for _ in range(max(iters, HOST_ITERS))]
    return max(0.0, float(np.median(diffs)))


def step_latencies(llm, r, iters: int) -> dict:
    """Step times (ms) for the round inputs ``r``: graph replays on CUDA, eager calls on CPU
    (the round staged by ``llm.steps.stage``)."""
    from .. import plugins
    from ..runtime.steps import verify_window
    steps, nets, N = llm.steps, llm.networks, llm.networks.num_spec_tokens
    st = steps.stage(r)
    x, graph = st.x, steps.replayable
    fns = {"draft_step_ms": st.draft, "verify_step_ms": st.verify, "ar_step_ms": st.ar}
    tokens, pos = verify_window(x, st.drafts)                                       # [B, N+1]
    z = st.z
    fns["target_forward_1_ms"] = graph(lambda: nets.target(tokens[:, :1], pos[:, :1], x.table))
    fns[f"target_forward_{N + 1}_ms"] = graph(lambda: nets.target(tokens, pos, x.table))
    if llm.draft is not None:
        vocab = llm.draft.draft_vocab                    # a draft vocabulary: its sampler's tables
        anchor, w1, w2 = vocab.markov_inputs(x.anchor) if vocab else (x.anchor, *llm.draft.markov_weights())
        U = torch.randn(*z.shape[:2], w2.shape[0], dtype=nets.dtype, device=z.device)
        fns["markov_sample_ms"] = graph(lambda: plugins.markov_sample(
            U, anchor, w1, w2, x.temperature, x.seed, x.start))
    cuda = nets.device.type == "cuda"          # CUDA events for eager GPU steps too (TP: no graphs)
    out = {k: time_ms(fn, iters, cuda) for k, fn in fns.items()}
    out["verify_over_ar"] = out["verify_step_ms"] / out["ar_step_ms"]
    out["target_verify_over_ar"] = out[f"target_forward_{N + 1}_ms"] / out["target_forward_1_ms"]
    if "markov_sample_ms" in out:
        out["markov_share_of_draft_step"] = out["markov_sample_ms"] / out["draft_step_ms"]
    return out


def cost_curve(llm, r, sizes: list[int], iters: int) -> dict:
    """Verify-step latency (target over [B, w] + acceptance; graph replays on CUDA) for every
    batch size B of ``sizes`` (rows of ``r``) and width w = 1 .. N+1 -> ``CostCurve`` points:
    total tokens B * w, latency made non-decreasing in tokens (the smallest latency measured at
    that many tokens or more); and per B the draft step's and the AR step's latency (``rows``,
    ``draft_ms``, ``ar_ms``: the scheduler's AR fallback compares them; ``ar_ms`` is the fallback's
    AR step, the plain one: its draft-context write is deferred and batched,
    ``runtime/deferred_context.py``); ``verify_ms`` [rows][w - 1]: each (B, w) as measured, the
    trimmed window's cost by rows and width (``CostCurve.verify_ms``); with a confidence head
    and a scheduler, ``admission_ms`` per B: the confidence round's steps (``draft_admit_step`` +
    ``verify_admit_step`` of all N) over the fixed round's (``CostCurve.admission_ms``), and
    ``draft_window_ms`` [rows][w - 1], w = 1 .. N - 1: the window rounds' draft step
    (``CostCurve.draft_window_ms``); ``host_ms`` per B: a fixed round called from the host
    (``steps.spec_round``: inputs staged, results read back) minus its draft and verify steps
    (``host_overhead_ms``), ``ar_host_ms`` likewise of the fallback's AR round
    (``steps.ar_round_keep_taps``), both non-decreasing in rows (``least_from_above``)
    (with CUDA graphs the round replays its bucket's graphs: a B that is not a bucket size counts
    the padding rows' device time as host time); ``context_tokens`` / ``context_ms``: the draft's
    context write by rows written (``context_points``). On the CPU the draft, AR and verify
    latencies take at least ``CPU_STEP_ITERS`` samples each."""
    from ..runtime.steps import DeviceInputs
    steps, nets, N = llm.steps, llm.networks, llm.networks.num_spec_tokens
    eager = steps.eager
    cuda = nets.device.type == "cuda"
    x_all = DeviceInputs.from_host(r, nets.device)
    xc_all = (DeviceInputs.from_host(r, nets.device, confidence=True)
              if getattr(nets, "has_confidence", False) and eager.scheduler is not None else None)
    drafts_all, z_all = eager.draft_step(x_all)
    points, rows, draft_ms, ar_ms, grid, admission, draft_window, host = {}, [], [], [], [], [], [], []
    ar_host = []
    context = {}
    step_iters = iters if cuda else max(iters, CPU_STEP_ITERS)
    for B in sorted(sizes):
        x = x_all.head(B)
        rows.append(B)
        draft = steps.replayable(lambda: eager.draft_step(x))
        draft_ms.append(time_ms(draft, step_iters, cuda))
        if xc_all is not None:
            xc = xc_all.head(B)

            def confidence_round():
                drafts, z, _, limit = eager.draft_admit_step(xc)
                return eager.verify_admit_step(xc, drafts, z, limit, False, N)

            fixed = steps.replayable(lambda: eager.verify_step(x, *eager.draft_step(x), False))
            confidence = steps.replayable(confidence_round)
            admission.append(max(0.0, time_ms(confidence, iters, cuda) - time_ms(fixed, iters, cuda)))
            draft_window.append([time_ms(steps.replayable(lambda w=w: eager.draft_step(x, w)), iters, cuda)
                                 for w in range(1, N)])
        # the fallback's AR step (what ``prefers_ar`` compares); it defers its context write
        ar = steps.replayable(lambda: eager.ar_step(x, False, keep_taps=True))
        ar_ms.append(time_ms(ar, step_iters, cuda))
        grid.append([])
        for w in range(1, N + 1):
            d, z = drafts_all[:B, :w].contiguous(), z_all[:B, :w].contiguous()
            fn = steps.replayable(lambda: eager.verify_step(x, d, z, False))
            ms = time_ms(fn, step_iters, cuda)
            grid[-1].append(ms)
            points[B * (w + 1)] = min(ms, points.get(B * (w + 1), float("inf")))
        host.append(host_overhead_ms(lambda: steps.spec_round(r.head(B), False), (draft, fn),
                                     [draft_ms[-1], grid[-1][-1]], iters, cuda))
        fallback_round = lambda: steps.ar_round_keep_taps(r.head(B), False)   # noqa: E731 (taps kept)
        ar_host.append(host_overhead_ms(fallback_round, (ar,), [ar_ms[-1]], iters, cuda))
        for n, ms in context_points(steps.context_rows, x, eager.ar_step(x, False, taps_out=True)[1], iters,
                                    cuda).items():
            context[n] = min(ms, context.get(n, float("inf")))
    tokens, lat = monotone(points)
    ctx_tokens, ctx_ms = monotone(context)
    # the scheduler compares these step costs with each other: each non-decreasing in rows, the
    # verify grid also in width (``least_from_above``); the host times too, whose medians of a few
    # dozen rounds moved by 0.1 ms between runs (H100, default pair, session 41: host_ms 0.100 then
    # 0.187 at 8 rows, 0.078-0.099 at 32-64, ~0.08 ms apart from the AR round's), which turned a
    # batch of 8 to AR rounds at 0.69x fixed N's tokens/s
    draft_ms, ar_ms = least_from_above(draft_ms), least_from_above(ar_ms)
    host, ar_host = least_measured_from_above(host), least_measured_from_above(ar_host)
    grid = [least_from_above(r) for r in grid]
    grid = [list(c) for c in zip(*[least_from_above(list(col)) for col in zip(*grid)])] if grid else grid
    return {"tokens": tokens, "latency_ms": lat, "rows": rows, "draft_ms": draft_ms, "ar_ms": ar_ms,
            "verify_ms": grid, "admission_ms": admission if xc_all is not None else None,
            "draft_window_ms": draft_window if xc_all is not None and N > 1 else None, "host_ms": host,
            "ar_host_ms": ar_host,
            "context_tokens": ctx_tokens or None, "context_ms": ctx_ms or None}


def monotone(points: dict) -> tuple[list, list]:
    """{tokens: ms} -> (tokens ascending, ms made non-decreasing: the least measured at that many
    tokens or more)."""
    tokens = sorted(points)
    ms = [points[t] for t in tokens]
    for i in range(len(ms) - 2, -1, -1):
        ms[i] = min(ms[i], ms[i + 1])
    return tokens, ms


def least_from_above(values: list) -> list:
    """Each value made at most every later one (a step of more rows, or a verify of more drafts,
    costs no less): a shared CPU's noise only stretches calls, so the least later measurement
    bounds an earlier one (a 1-row verify of one draft timed 19.6 ms against 16.6 for seven)."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def least_measured_from_above(values: list) -> list:
    """``least_from_above`` of host times, where a 0 (``host_overhead_ms`` clamps a round timed
    below its steps' events) is no measurement: it takes the least later measured value, or the
    last one before it, instead of zeroing every smaller row count."""
    out = least_from_above([v if v > 0 else math.inf for v in values])
    measured = [v for v in out if math.isfinite(v)]
    return [v if math.isfinite(v) else (measured[-1] if measured else 0.0) for v in out]


CONTEXT_ROWS = 64    # positions per row of the widest context write timed (the AR streaks' pool
                     # holds slots x 64 rows: deferred_context.SLOT_ROWS)


def context_points(writer, x, taps, iters: int, cuda: bool) -> dict:
    """{tokens: ms} of the draft's context write as a deferred flush makes it (``writer``: the
    steps' ``ContextRows``, whose writes replay a CUDA graph per row bucket under
    ``GraphedSteps``, else run eagerly), flat rows of the batch's rows ``x`` at 1 and at up to
    ``CONTEXT_ROWS`` positions each (their prompt positions, overwritten with the anchor's taps
    ``taps [B, m*d]``; the benchmark's requests are aborted after)."""
    B = taps.shape[0]
    widest = int(min(CONTEXT_ROWS, int(x.start.min())))
    out = {}
    for L in sorted({1, max(widest, 1)}):
        rows = writer.rows(B * L, taps)
        with torch.inference_mode():
            rows.copy_(taps.repeat_interleave(L, 0))                # row b * L + l: sequence b, position l
        positions, table_rows = np.tile(np.arange(L), B), np.repeat(np.arange(B), L)
        out[B * L] = time_ms(lambda: writer.write(rows, positions, table_rows, x.table), iters, cuda)
    return out


def run_cost_curve(llm, args, sizes: list[int]) -> int:
    from ..runtime.cost_curve import CostCurve
    prompts = make_prompts(llm, args.prompts, max(sizes), args.prompt_len, args.seed)
    gen = llm.scheduler()
    seqs = [gen.add_request(p.tolist(), _greedy(args.gen_len)) for p in prompts]
    gen.step()                                                       # prefill: a real context
    pts = cost_curve(llm, gen.round_inputs(seqs), sizes, args.iters)
    for s in seqs:
        gen.abort(s.request_id)
    device = torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu"
    curve = CostCurve.from_points(pts, f"dspark-trt bench --cost-curve, {device}, {provenance.git_sha()}, "
                                       f"batch sizes {sizes}, N={llm.networks.num_spec_tokens}")
    out = args.cost_curve_out or args.draft_checkpoint or args.engine
    for t, ms in zip(curve.tokens, curve.latency_ms):
        print(f"[bench] verify {t:5d} tokens: {ms:.3f} ms")
    if out and llm.tp_rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        print(f"[bench] wrote {curve.save(out, cost_file(llm.draft))}")       # a draft vocabulary's own name
    else:
        print("[bench] cost curve not written (no --cost-curve-out and no checkpoint / engine directory)")
    return 0


def end_to_end(llm, prompts: np.ndarray, gen_len: int, speculative: bool,
               verify_mode: str = "fixed", seed: int | None = None) -> dict:
    """Greedy decoding of ``prompts`` [B, T]; decode throughput excludes the prefill step.
    ``seed``: request i samples with seed ``seed + i`` (else drawn at admission)."""
    from ..runtime import SamplingParams
    gen = llm.scheduler(speculative)
    sp = [SamplingParams(max_new_tokens=gen_len, ignore_eos=True, verify_mode=verify_mode,
                         seed=None if seed is None else seed + i) for i in range(len(prompts))]
    seqs = [gen.add_request(p.tolist(), s) for p, s in zip(prompts, sp)]
    gen.step()                                   # admission + prefill (+ first token)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    t0, rounds = time.perf_counter(), 0
    while gen.has_work():
        gen.step()
        rounds += 1
    dt = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) - 1 for s in seqs)
    return {**decode_stats(seqs, tokens, rounds, dt), "output_ids_row0": seqs[0].output_ids}


def decode_stats(seqs, tokens: int, rounds: int, seconds: float) -> dict:
    """tokens/s, round time, tau and verified tokens per request per round of decoded ``seqs``."""
    committed = [c for s in seqs for c in s.stats.committed]
    return {"decode_tokens_per_s": tokens / seconds, "rounds": rounds,
            "round_ms": seconds / max(rounds, 1) * 1e3,
            "tau": sum(committed) / len(committed) if committed else None,
            "verified_per_round": (sum(p for s in seqs for p in s.stats.proposed) / len(committed) + 1
                                   if committed else None)}


def uses_random_weights(llm, args) -> bool:
    """--random-weights, or an engine built with random weights (its manifest says so)."""
    manifest = getattr(llm.networks, "manifest", None) or {}
    return bool(args.random_weights or manifest.get("build_options", {}).get("random_weights"))


def make_prompts(llm, kind: str, n: int, length: int, seed: int) -> np.ndarray:
    """[n, length] prompt ids: uniform random ids, or windows of the stdlib modules the shipped
    default pair never saw (``DEFAULT_PAIR_HELDOUT``), as its training run's Python had them
    (``train.heldout_texts``: the same prompts on every machine, whatever its Python)."""
    if kind == "random":
        return np.random.default_rng(seed).integers(0, llm.pair.target.vocab_size, (n, length))
    if llm.tokenizer is None:
        raise SystemExit("error: --prompts heldout needs a model with a tokenizer")
    from ..train.batches import encode_files, eval_prompts
    from ..train.heldout_texts import load_heldout_texts
    ids = encode_files(llm.tokenizer, load_heldout_texts())
    return np.array(eval_prompts(ids, n, length, length, seed=seed), dtype=np.int64)


# ---- roofline -------------------------------------------------------------------------------------

def qwen3_weight_bytes(cfg, num_layers: int, element_size: int, with_head: bool = True,
                       fp8_projections: bool = False) -> int:
    """Bytes of weights a decode step reads (embedding rows excluded, LM head included);
    ``fp8_projections``: q/k/v/o and the MLP in fp8 with an fp32 scale per 128x128 block."""
    d, D, h, hkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    shapes = [(h * D, d), (hkv * D, d), (hkv * D, d), (d, h * D), (I, d), (I, d), (d, I)]     # [N, K] each
    proj = sum(n * k for n, k in shapes)
    if fp8_projections:
        proj_bytes = proj + 4 * sum(-(-n // 128) * -(-k // 128) for n, k in shapes)
    else:
        proj_bytes = element_size * proj
    layer = proj_bytes + element_size * (2 * d + 2 * D)
    return num_layers * layer + element_size * (d + (cfg.vocab_size * d if with_head else 0))


def rank_step_bytes(module: torch.nn.Module) -> int:
    """Parameters one rank's decode step reads: its shards, the embedding table excluded."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters()
               if "embed_tokens" not in n)


def context_step_latencies(llm, prompts: np.ndarray, gen_len: int, iters: int, context: int,
                           tbps: float) -> dict:
    """``step_latencies`` of a batch of ``prompts`` [B, context] after their real prefill, with
    the roofline of that batch and context (``roofline``) and the AR step's efficiency against it."""
    gen = llm.scheduler()
    seqs = [gen.add_request(p.tolist(), _greedy(gen_len)) for p in prompts]
    gen.step()                                                   # prefill: a real context
    row = step_latencies(llm, gen.round_inputs(seqs), iters)
    for s in seqs:
        gen.abort(s.request_id)
    gen.step()
    row.update(roofline(llm, len(prompts), context, tbps))
    if "ar_roofline_ms" in row:
        row["ar_roofline_efficiency"] = row["ar_roofline_ms"] / row["ar_step_ms"]
    return row


def roofline(llm, B: int, context: int, tbps: float) -> dict:
    """Per-rank HBM roofline of the Qwen3 steps (under TP: this rank's weight shards and KV heads;
    an fp8 target or draft: its parameters' bytes as held, fp8 weights + fp32 block scales)."""
    el = torch.empty((), dtype=llm.networks.dtype).element_size()
    t, tp = llm.pair.target, llm.tp_size
    if t.arch != "qwen3":
        return {"roofline_skipped": f"the roofline counts Qwen3 layers, not '{t.arch}'"}
    fp8 = getattr(t, "quantization", None) == "fp8"                   # fp8 projections (modules or engine)
    if tp == 1 and (llm.target is None or not fp8):
        w = qwen3_weight_bytes(t, t.num_hidden_layers, el, fp8_projections=fp8)
    else:
        w = rank_step_bytes(llm.target)
    kv = B * context * 2 * t.num_hidden_layers * t.num_key_value_heads // tp * t.head_dim * el
    out = {"target_weight_bytes": w, "target_kv_read_bytes": kv,
           "ar_roofline_ms": (w + kv) / (tbps * 1e12) * 1e3}
    if llm.pair.draft is not None and llm.networks.num_spec_tokens:
        dc = llm.pair.draft.layer_config()
        vocab = getattr(llm.draft, "draft_vocab", None)          # a draft vocabulary: its rows only
        vs = (vocab.token_ids.numel() if vocab is not None
              else getattr(llm.networks, "draft_vocab_size", None) or dc.vocab_size)     # (an engine's)
        dfp8 = has_fp8(llm.draft) if llm.draft is not None else getattr(llm.networks, "draft_fp8", False)  # engine: manifest
        dw = (qwen3_weight_bytes(dc, dc.num_hidden_layers, el, with_head=False, fp8_projections=dfp8)
              + el * vs * dc.hidden_size)                          # + head; --draft-quantization fp8 counted
        dw += el * (len(llm.pair.draft.target_layer_ids) * dc.hidden_size * dc.hidden_size
                    + dc.hidden_size + 2 * vs * llm.pair.draft.markov_rank)  # fc, hidden_norm, W1/W2
        if tp > 1:
            dw = rank_step_bytes(llm.draft)
        dkv = B * context * 2 * dc.num_hidden_layers * dc.num_key_value_heads // tp * dc.head_dim * el
        out.update(draft_weight_bytes=dw, draft_roofline_ms=(dw + dkv) / (tbps * 1e12) * 1e3)
    return out


# ---- report -----------------------------------------------------------------------------------------

def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    for m in ("triton", "transformers", "cuda.bindings"):
        try:
            mod = __import__(m, fromlist=["_"])
            v[m] = getattr(mod, "__version__", "?")
        except ImportError:
            v[m] = None
    return v


def load_hf_peer():
    path = REPO / "benchmarks" / "hf_peer.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("dspark_hf_peer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_targets(b1: dict) -> dict:
    out = {}
    for name, (key, bound, op) in TARGETS.items():
        v = b1.get(key)
        met = None if v is None else (v <= bound if op == "le" else v >= bound)
        out[name] = {"metric": key, "value": v, "bound": bound, "met": met}
    return out


def eager_path(llm) -> dict:
    """How the steps run: engine networks, or eager modules (fused projections, compiled)."""
    if llm.target is None:
        return {"engine": True}
    from ..models.fuse import FusedLinear
    fused = any(isinstance(m, FusedLinear) for m in llm.target.modules())
    return {"engine": False, "fused_projections": fused, "compiled": llm.compiled}


def batch_sweep(results: dict, hf: dict, context: int) -> list[dict]:
    """Per batch size (ascending): the AR / verify / draft steps against their HBM roofline
    (efficiency = roofline / measured) and the compiled HF peer's step where it ran."""
    hf_runs = {r["batch_size"]: r for r in hf.get("runs", [])
               if r.get("mode") == "compiled" and "decode_step_ms" in r}
    rows = []
    for B in sorted(results):
        r = results[B]
        roof = r.get("ar_roofline_ms")
        eff = (lambda ms: roof / ms if roof and ms else None)  # noqa: E731
        row = {"batch_size": B, "context_tokens": context,
               "weight_bytes": r.get("target_weight_bytes"), "kv_read_bytes": r.get("target_kv_read_bytes"),
               "ar_step_ms": r["ar_step_ms"], "ar_roofline_ms": roof,
               "ar_roofline_efficiency": eff(r["ar_step_ms"]),
               "verify_step_ms": r.get("verify_step_ms"),
               "verify_roofline_efficiency": eff(r.get("verify_step_ms"))}
        if r.get("draft_roofline_ms") and r.get("draft_step_ms"):
            row.update(draft_step_ms=r["draft_step_ms"], draft_roofline_ms=r["draft_roofline_ms"],
                       draft_roofline_efficiency=r["draft_roofline_ms"] / r["draft_step_ms"])
        h = hf_runs.get(B)
        if h:
            row.update(hf_compiled_step_ms=h["decode_step_ms"],
                       hf_compiled_roofline_efficiency=h.get("roofline_efficiency"),
                       ar_speedup_vs_hf_compiled=h["decode_step_ms"] / r["ar_step_ms"])
        rows.append(row)
    return rows


def write_plot(report: dict, json_path: Path) -> str:
    """``<json stem>.png`` by ``benchmarks/plot_bench.py``; the path, or why none was written."""
    path = REPO / "benchmarks" / "plot_bench.py"
    if not path.exists():
        return "not written: benchmarks/plot_bench.py not found (run from the repository)"
    if importlib.util.find_spec("matplotlib") is None:
        return "not written: matplotlib is not installed"
    spec = importlib.util.spec_from_file_location("dspark_plot_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return str(mod.plot(report, json_path.with_suffix(".png")))
    except Exception as e:                      # a plot never fails the bench
        return f"not written: {type(e).__name__}: {e}"


def step_path_kwargs(args) -> dict:
    """The ``LLM`` options of ``--compile`` / ``--unfused``: how the eager modules' steps run."""
    kw = {"compile": args.compile} if args.compile else {}
    if args.unfused:
        kw["fuse"] = False
    return kw


def run(args) -> int:
    t_start = time.perf_counter()
    if args.model and not (args.checkpoint or args.engine) and not args.random_weights:
        raise SystemExit("error: --model without checkpoints benchmarks RANDOM weights: "
                         "add --random-weights to confirm")
    sizes, hf_sizes = _ints(args.batch_sizes), _ints(args.hf_batch_sizes)
    hf_modes = [] if args.hf == "none" else [m.strip() for m in args.hf.split(",") if m.strip()]
    args.max_batch_size = max(sizes)
    args.max_seq_len = args.prompt_len + args.gen_len
    llm = load_llm(args, **step_path_kwargs(args))
    if args.graph_backend:
        llm.graph_backend = args.graph_backend
    cuda = llm.device.type == "cuda"
    args.hbm_tbps = args.hbm_tbps or hbm_bytes_per_s(torch.cuda.get_device_name(llm.device) if cuda else "") / 1e12
    t_load = time.perf_counter() - t_start
    print(f"[bench] model ready in {t_load:.1f} s; graphs: {llm.graphs_skipped or 'on'}")
    if args.cost_curve:
        return run_cost_curve(llm, args, sizes)

    t0 = time.perf_counter()
    for spec in (True, False):
        llm.capture_graphs(spec)
    t_capture = time.perf_counter() - t0
    print(f"[bench] graphs captured in {t_capture:.1f} s")

    random_weights = uses_random_weights(llm, args)
    all_prompts = make_prompts(llm, args.prompts, max(sizes), args.prompt_len, args.seed)
    results, skipped = {}, []
    hf_reserve = 120.0 if hf_modes else 0.0
    for B in bar(sorted(sizes), desc="bench batch sizes", unit="batch"):
        if _rank0_says(time.perf_counter() - t_start > args.time_budget_s - hf_reserve, llm):
            skipped.append(B)
            continue
        prompts = all_prompts[:B]
        row = context_step_latencies(llm, prompts, args.gen_len, args.iters, args.prompt_len, args.hbm_tbps)
        spec, ar = end_to_end(llm, prompts, args.gen_len, True), end_to_end(llm, prompts, args.gen_len, False)
        row["speculative"], row["autoregressive"] = spec, ar
        for mode in [m.strip() for m in args.verify_modes.split(",") if m.strip() not in ("", "fixed")]:
            row[f"speculative_{mode}"] = e2e = end_to_end(llm, prompts, args.gen_len, True, mode)
            e2e["speedup_vs_fixed"] = e2e["decode_tokens_per_s"] / spec["decode_tokens_per_s"]
            e2e["speedup_vs_autoregressive"] = e2e["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
            print(f"[bench] B={B:3d} {mode}: {e2e['decode_tokens_per_s']:.0f} tok/s "
                  f"(x{e2e['speedup_vs_fixed']:.2f} fixed N), {e2e['verified_per_round']:.2f} verified "
                  f"per round, tau {e2e['tau']:.2f}", flush=True)
        row["spec_host_overhead"] = 1 - (row["draft_step_ms"] + row["verify_step_ms"]) / spec["round_ms"]
        row["ar_host_overhead"] = 1 - row["ar_step_ms"] / ar["round_ms"]
        row["speedup_measured"] = spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
        row["step_model_speedup"] = spec["tau"] * row["ar_step_ms"] / (row["draft_step_ms"] + row["verify_step_ms"])
        if not random_weights:                   # the criterion is meant for a trained pair
            row["speedup_over_step_model"] = row["speedup_measured"] / row["step_model_speedup"]
        proj = B * args.paper_tau / (spec["round_ms"] / 1e3)
        row["projection_at_paper_tau"] = {"tau": args.paper_tau, "spec_tokens_per_s": proj,
                                          "speedup_vs_autoregressive": proj / ar["decode_tokens_per_s"]}
        results[B] = row
        eff = row.get("ar_roofline_efficiency")
        print(f"[bench] B={B:3d} ar {row['ar_step_ms']:.3f} ms ("
              f"{'n/a' if eff is None else f'{eff:.0%}'} of roofline) draft {row['draft_step_ms']:.3f} verify {row['verify_step_ms']:.3f} ms | "
              f"spec {spec['decode_tokens_per_s']:.0f} tok/s tau {spec['tau']:.2f} | ar "
              f"{ar['decode_tokens_per_s']:.0f} tok/s | projected x{row['projection_at_paper_tau']['speedup_vs_autoregressive']:.2f}",
              flush=True)

    hf = run_hf_peer(llm, all_prompts, hf_sizes, hf_modes, args, results)
    b1 = dict(results.get(1, {}))
    if b1 and hf.get("best_b1_tokens_per_s"):
        b1["speedup_vs_hf"] = b1["speculative"]["decode_tokens_per_s"] / hf["best_b1_tokens_per_s"]
        b1["projection_at_paper_tau"]["speedup_vs_hf"] = (
            b1["projection_at_paper_tau"]["spec_tokens_per_s"] / hf["best_b1_tokens_per_s"])
        results[1]["speedup_vs_hf"] = b1["speedup_vs_hf"]
    report = {
        "git_sha": provenance.git_sha(), "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions(),
        "parallel": {"tp_size": llm.tp_size, "world": _world(), "nodes": _nodes(),
                     "expert_parallel": bool(getattr(args, "expert_parallel", False))},
        "model": {"preset": args.model, "checkpoint": args.checkpoint, "engine": args.engine,
                  "random_weights": random_weights, "dtype": str(llm.networks.dtype),
                  "num_spec_tokens": llm.networks.num_spec_tokens},
        "options": {k: v for k, v in vars(args).items() if k != "func"},
        "eager_path": eager_path(llm),
        "graph_backend": getattr(llm.steps, "backend", None), "graphs_skipped": llm.graphs_skipped,
        "seconds": {"load": t_load, "capture": t_capture, "total": time.perf_counter() - t_start},
        "batch": {str(b): {k: v for k, v in r.items()} for b, r in results.items()},
        "sweep": batch_sweep(results, hf, args.prompt_len),
        "skipped_batch_sizes_time_budget": skipped, "hf_peer": hf,
        "targets_b1": check_targets(b1) if b1 else {},
        "notes": ["projection_at_paper_tau: measured round time with tau set to the paper's "
                  "Qwen3-8B GSM8K value (a projection, not a measurement)",
                  "random weights: measured tau is that of an untrained draft",
                  "step_model_speedup = tau x ar_step / (draft_step + verify_step); "
                  "speedup_over_step_model = speedup_measured / step_model_speedup (trained weights only)",
                  "sweep: roofline = (weights + KV read at the context) / hbm_tbps per step; the verify "
                  "step's is the AR step's (same weights and KV); hf_compiled_* at the HF run's mean "
                  "context (prompt + gen_len / 2)"],
    }
    out_dir = Path(args.out_dir)
    gpu = report["gpu"].replace(" ", "-").replace("/", "-")
    tp_tag = f"-tp{llm.tp_size}" if llm.tp_size > 1 else ""
    path = out_dir / f"bench-{gpu}{tp_tag}-{report['git_sha']}.json"
    if llm.tp_rank == 0:                          # one report per run: rank 0 writes it
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.plot == "on":
            report["plot"] = write_plot(report, path)
        path.write_text(json.dumps(report, indent=1, default=str))
    for name, t in report["targets_b1"].items():
        v = t["value"]
        state = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        print(f"[bench] target {name}: {state} ({t['metric']} = {'n/a' if v is None else f'{v:.3f}'})")
    print(f"[bench] wrote {path} in {report['seconds']['total']:.0f} s")
    return 0


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


def _nodes() -> int:
    """Nodes of the torchrun launch (GROUP_WORLD_SIZE; 1 outside torchrun)."""
    from ..parallel.topology import Launch
    return Launch.from_env().nodes or 1


def _rank0_says(flag: bool, llm) -> bool:
    """Under TP every rank must take the same branch (they share collectives): rank 0 decides."""
    if llm.tp_size == 1:
        return flag
    import torch.distributed as dist
    t = torch.tensor([int(flag)], device=llm.device)
    dist.broadcast(t, 0)
    return bool(t.item())


def _greedy(n: int):
    from ..runtime import SamplingParams
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_hf_peer(llm, all_prompts, sizes: list[int], modes: list[str], args, results) -> dict:
    if not modes:
        return {"skipped": "--hf none"}
    if llm.tp_size > 1:
        return {"skipped": "the HF peer runs on one GPU; not compared under tensor parallelism"}
    peer = load_hf_peer()
    if peer is None:
        return {"skipped": "benchmarks/hf_peer.py not found (run from the repository)"}
    if llm.pair.target.arch != "qwen3":
        return {"skipped": f"the HF peer is transformers' Qwen3, the target is '{llm.pair.target.arch}'"}
    why = peer.transformers_missing_reason()
    if why:
        return {"skipped": why}
    try:
        if llm.target is not None:
            weights, source = llm.target, "the LLM's target modules"
        else:                                     # the engine path: the engine directory's weights
            weights, source = peer.engine_target_state(args.engine, llm.networks.manifest, llm.pair,
                                                       llm.device)
        model = peer.build_hf_qwen3(weights, llm.pair.target)
        del weights
    except Exception as e:                        # transformers incompatible, weights unreadable
        return {"skipped": f"could not build the HF model: {type(e).__name__}: {e}"}
    out, best = {"runs": [], "weights": source}, None
    for B in sizes:
        ids = torch.from_numpy(all_prompts[:B]).to(llm.device)
        for mode in modes:
            try:
                r = peer.measure_hf_decode(model, ids, args.gen_len, mode)
            except Exception as e:
                out["runs"].append({"mode": mode, "batch_size": B, "error": f"{type(e).__name__}: {e}"})
                continue
            roof = roofline(llm, B, args.prompt_len + args.gen_len // 2, args.hbm_tbps).get("ar_roofline_ms")
            if roof:
                r["roofline_ms"], r["roofline_efficiency"] = roof, roof / r["decode_step_ms"]
            ours = results.get(B, {}).get("autoregressive", {}).get("output_ids_row0")
            hf_ids = r.pop("output_ids")[0]
            if ours:
                same = next((i for i, (a, b) in enumerate(zip(ours, hf_ids)) if a != b), len(hf_ids))
                r["greedy_tokens_equal_to_ours_prefix"] = same
            out["runs"].append(r)
            print(f"[bench] HF {mode} B={B}: {r['decode_tokens_per_s']:.0f} tok/s "
                  f"({r['decode_step_ms']:.2f} ms/token, first call {r['first_call_s']:.1f} s)", flush=True)
            if B == 1:
                best = max(best or 0.0, r["decode_tokens_per_s"])
    out["best_b1_tokens_per_s"] = best
    del model
    return out


if __name__ == "__main__":                       # python -m dspark_trt.commands.bench ...
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["bench"] + sys.argv[1:])
    sys.exit(a.func(a))
