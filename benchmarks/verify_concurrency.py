"""Throughput vs concurrency of the verify modes (issue #25): fixed N, scheduled, threshold and
autoregressive decoding at batch 1 .. 64; tokens/s, verified tokens per request per round, and the
verify windows the confidence rounds ran. JSON + PNG to ``--out-dir``.

Every run goes through ``dspark-trt bench``'s end-to-end loop (``commands.bench.end_to_end``: the
Scheduler over the public round interface, ``steps.spec_round_admitted``). Before the runs the
verify cost curve is measured on this model (``commands.bench.cost_curve``) and given to the
scheduler, so "scheduled" trims its verify window where that curve says a narrower one pays.

``--load steady`` measures what a server at concurrency B sees instead of one static batch: B
requests in flight, asking for gen_len / 2 .. 3 gen_len / 2 new tokens each (the same lengths for
every mode), each finished one replaced by a new prompt at once (continuous batching, its
prefill inside the window) until ``--waves`` x B requests were submitted; tokens/s over the rounds
from the first replacement to the last submission, while all B slots are busy. A static batch
(``--load static``, the default) ends when its slowest request ends, which penalises the modes whose
per-request progress varies (speculative rounds) against AR; the steady load has no such tail.

``--synthetic FILE`` (random weights, where acceptance means nothing): the networks are wrapped by
``SyntheticAcceptance``, which replays the trained default pair's measured prefix-survival curve
(``before.per_position[k].label_mean`` of a ``dspark-trt calibrate`` JSON) as the confidence head's
output and as the verifier's acceptance: per row and round a logistic offset ``e`` (keyed by seed
and position), conditional acceptance ``q_k = sigmoid(b_k + spread * e)`` with ``b_k`` chosen so
that the rows' mean prefix survival is the curve's (``replay_logits``; ``logit(p_k)`` of the
curve's conditional acceptance at spread 0), confidence logit ``logit(q_k)`` (calibrated by
construction) and draft k accepted iff ``u_k < q_k`` for a keyed uniform ``u``. Until session 39
``b_k`` was ``logit(p_k)`` at every spread, which replayed the trained pair's curve (tau 1.75) with
a fatter tail (tau 2.42 at spread 1): results before then measured that easier load. The target
and draft networks still run in full (their cost is what is measured); only the accepted count is replaced. The scheduler
gets the calibration such a pair would ship with: temperatures 1 and the curve as its held-out
survival (a fresh batch's starting estimate, ``SurvivalEstimate``).

    python benchmarks/verify_concurrency.py --device cpu --batch-sizes 1,2,4,8,16,32,64 --gen-len 16
    python benchmarks/verify_concurrency.py --plot benchmarks/results/verify-concurrency-cpu-<sha>.json
    python benchmarks/verify_concurrency.py --model qwen3-8b-dspark-block7 --random-weights --dtype bf16 \
        --synthetic benchmarks/results/confidence-calibration-h200-462ac15.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark_trt import plugins, provenance  # noqa: E402
from dspark_trt.commands import bench  # noqa: E402
from dspark_trt.plugins import rng  # noqa: E402

MODES = ("fixed", "scheduled", "threshold")
EXTRA_MODES = {"packed": ("scheduled", "packed"), "auto": ("scheduled", "auto")}   # bench mode -> (verify_mode, cost model)
STREAM_SYNTH_ROW, STREAM_SYNTH_ACCEPT = 11, 12       # keyed streams of the synthetic acceptance


def survival_curve(path: str | Path) -> list[float]:
    """Prefix survival ``P(drafts 0..k accepted)`` per position from a calibrate JSON."""
    d = json.loads(Path(path).read_text())
    try:
        return [float(p["label_mean"]) for p in d["before"]["per_position"]]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"error: {path}: needs before.per_position[*].label_mean ({e})") from None


def conditional_acceptance(survival: list[float], n: int) -> list[float]:
    """[n] the conditional acceptances ``p_k = s_k / s_{k-1}`` of a prefix-survival curve (clipped
    away from 0 and 1; a curve shorter than n repeats its last ratio): what ``SyntheticAcceptance``
    offsets per row."""
    s = [min(max(v, 1e-4), 1 - 1e-4) for v in survival] or [0.5]
    cond = [s[0]] + [min(b / a, 0.999) for a, b in zip(s, s[1:])]
    return (cond + [cond[-1]] * max(0, n - len(cond)))[:n]


def replay_logits(survival: list[float], n: int, spread: float, points: int = 4096) -> np.ndarray:
    """[n] the per-position logits ``b_k`` of ``SyntheticAcceptance``: rows whose conditional
    acceptance is ``q_{r,k} = sigmoid(b_k + spread * logit(u_r))`` (one uniform ``u_r`` per row and
    round) survive draft k with mean ``prod_{j<=k} q_{r,j}`` equal to the curve's ``s_k`` (of
    ``conditional_acceptance``: clipped, a short curve extended). ``b_k = logit(p_k)`` at spread 0;
    with a spread the confident rows survive, so ``logit(p_k)`` would fatten the tail (the
    trained pair's curve, tau 1.75, replayed at spread 1 as tau 2.42). Bisection per position over
    ``points`` quantiles of u."""
    cond = np.asarray(conditional_acceptance(survival, n), dtype=np.float64)
    if spread == 0:
        return np.log(cond / (1 - cond))
    u = (np.arange(points) + 0.5) / points
    offset = spread * np.log(u / (1 - u))                                     # [points]
    alive, target, out = np.ones(points), 1.0, []
    for p in cond:
        target *= p                                                           # s_k
        lo, hi = -60.0, 60.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if (alive / (1 + np.exp(-(mid + offset)))).mean() < target else (lo, mid)
        out.append(0.5 * (lo + hi))
        alive = alive / (1 + np.exp(-(out[-1] + offset)))
    return np.array(out)


def synthetic_rows(rng: np.random.Generator, rows: int, logits: np.ndarray, spread: float) -> np.ndarray:
    """[rows, n] conditional acceptances ``q`` of ``rows`` rows of ``SyntheticAcceptance``, drawn
    with ``rng`` (``replay_logits``' ``logits``)."""
    u = rng.uniform(1e-12, 1 - 1e-12, size=(rows, 1))
    return 1.0 / (1.0 + np.exp(-(logits[None] + spread * np.log(u / (1 - u)))))


class SyntheticAcceptance:
    """``networks`` with the confidence logits and the verifier's accepted counts replayed from a
    survival curve (see the module docstring); everything else is the wrapped networks'."""

    def __init__(self, networks, survival: list[float], spread: float = 1.0):
        self.inner, self.spread = networks, spread
        logits = replay_logits(survival, networks.num_spec_tokens, spread)
        self.logit_p = torch.tensor(logits, dtype=torch.float32).to(networks.device)
        self.has_confidence = True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _conf_logits(self, seed, start, n: int):
        """[B, n] logit(q_{r,k})."""
        u = rng.uniform(seed, start, STREAM_SYNTH_ROW, 1)                               # [B, 1]
        return self.logit_p[None, :n] + self.spread * torch.logit(u)

    def draft_block_confidence(self, anchor, start, table, temperature, seed, width=None, z_out=None):
        drafts, z = self.inner.draft_block(anchor, start, table, temperature, seed, width=width, z_out=z_out)
        return drafts, z, self._conf_logits(seed, start, drafts.shape[1])

    def verify(self, logits, drafts, z, temperature, seed, start):
        self.inner.verify(logits, drafts, z, temperature, seed, start)  # its cost stays in the step
        n = drafts.shape[1]
        q = torch.sigmoid(self._conf_logits(seed, start, n))
        u = rng.uniform(seed, start, STREAM_SYNTH_ACCEPT, n)
        acc = torch.cumprod((u < q).to(torch.int64), 1).sum(1)                         # [B]
        row = logits.gather(1, acc[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        return acc, plugins.sample_tokens(row, temperature, seed, start + acc + 1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    bench.add_parser(sub)                                   # bench's model / size options
    b = sub.choices["bench"]
    b.add_argument("--synthetic", default=None,
                   help="calibrate JSON whose survival curve is replayed as confidence + acceptance")
    b.add_argument("--spread", type=float, default=1.0, help="per-row logistic spread (synthetic)")
    b.add_argument("--prices", default=None,
                   help="the scheduler decides with this cost curve instead of one measured here: a "
                        "verify_concurrency JSON (its 'cost_curve', .json or .json.gz) or a verify_cost.json; "
                        "e.g. a GPU run's prices replayed on the CPU, to study its decisions")
    b.add_argument("--modes", default=",".join(MODES),
                   help=f"of {MODES + tuple(EXTRA_MODES)}; 'packed': scheduled with the packed "
                        "variable-length verify (each row its own admitted prefix); 'auto': scheduled with "
                        "the 'auto' cost model (packed from PACKED_MIN_ROWS rows, trimmed below); "
                        "'scheduled': LLM's default, the trimmed model")
    b.add_argument("--load", choices=("static", "steady"), default="static",
                   help="static: one batch of B requests; steady: B in flight, replaced as they finish")
    b.add_argument("--waves", type=int, default=4, help="steady load: requests submitted = waves x B")
    b.add_argument("--min-requests", type=int, default=16,
                   help="steady load: at least this many requests per point (small batches)")
    b.add_argument("--round-kinds", action="store_true",
                   help="also time one round of each kind per batch (fixed, confidence with the "
                        "read-back, estimated window without it)")
    b.add_argument("--profile-kinds", action="store_true",
                   help="with --round-kinds: each kind's kernel breakdown too (torch.profiler, a GPU)")
    b.add_argument("--profile-top", type=int, default=15,
                   help="with --profile-kinds: the kernels kept per round kind, largest total first")
    b.add_argument("--tag", default=None, help="file name tag (default: cpu / the GPU name)")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs of every mode per batch, interleaved, each repeat in a rotated order (fixed, "
                        "scheduled, AR; scheduled, AR, fixed; ...: no mode always follows the same one): "
                        "the row keeps the median run's record and each run's tokens/s, and reports the "
                        "per-repeat ratios to fixed and AR (paired: neighbouring runs share the machine's drift)")
    b.add_argument("--learn-round-costs", action="store_true",
                   help="the AR fallback scales the curve's prices by the rounds' observed walls "
                        "(runtime/round_costs.py; opt-in)")
    b.set_defaults(batch_sizes="1,2,4,8,16,32,64", gen_len=32, prompt_len=64, iters=5, hf="none")
    return p.parse_args(["bench"] + list(argv))


def read_json(path: str | Path):
    """A results JSON, plain or ``.json.gz``."""
    path = Path(path)
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def load_prices(path: str):
    """``CostCurve`` of ``--prices``: a verify_concurrency JSON's ``cost_curve`` (.json / .json.gz)
    or a ``verify_cost.json``."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    from dspark_trt.runtime.cost_curve import CostCurve
    try:
        d = read_json(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --prices {path}: not a readable JSON file ({e})") from None
    pts = d.get("cost_curve", d) if isinstance(d, dict) else None
    if not isinstance(pts, dict):
        raise SystemExit(f"error: --prices {path}: no cost curve (a 'cost_curve' object or a verify_cost.json)")
    try:
        return CostCurve.from_json(pts, f"--prices {path}")
    except ConfidenceFileError as e:
        raise SystemExit(f"error: {e}") from None


def measure_cost_curve(llm, args, sizes):
    """``bench.cost_curve`` on a prefilled batch -> ``CostCurve``."""
    from dspark_trt.runtime.cost_curve import CostCurve
    prompts = bench.make_prompts(llm, args.prompts, max(sizes), args.prompt_len, args.seed)
    gen = llm.scheduler()
    seqs = [gen.add_request(q.tolist(), bench._greedy(args.gen_len)) for q in prompts]
    gen.step()
    pts = bench.cost_curve(llm, gen.round_inputs(seqs), sizes, args.iters)
    for s in seqs:
        gen.abort(s.request_id)
    gen.step()
    return CostCurve.from_points(pts, "measured by benchmarks/verify_concurrency.py")


def round_kinds(llm, args, B: int, survival, iters: int = 20, packed: bool = False,
                profile: bool = False) -> dict:
    """Wall ms of one round of each kind at ``B`` rows after a prefill of ``args.prompt_len``
    (host in, host out, as the Scheduler pays it): "fixed" (draft + verify of N), "confidence"
    (head + admission, read-back of the admitted lengths, verify of that window),
    "estimated" (head + admission, verify of ``best_window(B, survival)`` without the
    read-back), "window" (the window round of that width: its drafts only, no head, no
    admission) and with ``packed`` "packed" (the packed cost model's admission, read-back,
    packed verify of the admitted prefixes) and "packed_head" (that round drafting
    ``VerifyScheduler.head_width`` drafts, where fewer than N). Rounds are not committed: each replays the same
    positions. ``profile``: also each kind's kernels (``profile_step.profile_fn``: kernel time per
    round against its CUDA-event wall, the top kernels) under ``profiles``, and the slot buckets
    the packed rounds ran."""
    from dspark_trt.runtime import SamplingParams
    from dspark_trt.runtime.sampling_modifiers import Modifiers
    prompts = bench.make_prompts(llm, args.prompts, B, args.prompt_len, args.seed)
    sp = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True, verify_mode="scheduled")
    gen = llm.scheduler()
    seqs = [gen.add_request(q.tolist(), sp) for q in prompts]
    gen.step()
    r, mods = gen.round_inputs(seqs), Modifiers.for_params([sp] * B)
    sched = llm.steps.eager.scheduler
    w = sched.best_window(B, survival)
    kinds = {"fixed": lambda: llm.steps.spec_round(r, mods),
             "confidence": lambda: llm.steps.spec_round_admitted(r, mods),
             "estimated": lambda: llm.steps.spec_round_admitted(r, mods, width=w),
             "window": lambda: llm.steps.spec_round(r, mods, width=w)}
    head = sched.head_width(B, survival)                 # a packed round's drafted width
    if packed:
        kinds["packed"] = lambda: llm.steps.spec_round_admitted(r, mods)
        if head < sched.num_spec_tokens:
            kinds["packed_head"] = lambda: llm.steps.spec_round_admitted(r, mods, head=head)
    out = {"estimated_window": w, "head_width": head}
    model = sched.configured
    for name, fn in kinds.items():
        sched.cost_model = "packed" if name.startswith("packed") else model
        fn()                                                      # warm (graph capture)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[f"{name}_ms"] = 1e3 * (time.perf_counter() - t0) / iters
        if profile:
            from profile_step import profile_fn
            llm.steps.verify_slots.clear()
            out.setdefault("profiles", {})[name] = profile_fn(fn, reps=3, top=args.profile_top)
            if name.startswith("packed"):
                out["profiles"][name]["verify_slots"] = {str(k): v for k, v in llm.steps.verify_slots.items()}
    sched.cost_model = model
    draft = sched.cost.step_ms("draft", B)               # the curve's prediction, as the scheduler prices it
    out["curve_fixed_ms"] = draft + sched.cost.window_ms(B, sched.num_spec_tokens)
    out["curve_window_ms"] = draft + sched.cost.window_ms(B, w)
    out["curve_window_round_ms"] = sched.cost.draft_window(B, w) + sched.cost.window_ms(B, w)   # its draft: w rows
    for s in seqs:
        gen.abort(s.request_id)
    gen.step()
    return out


def steady_range(gen_len: int) -> tuple[int, int]:
    """The steady load's new tokens per request: [gen_len / 2, 3 gen_len / 2]."""
    return max(1, gen_len // 2), max(1, (3 * gen_len) // 2)


def steady_lengths(n: int, gen_len: int, seed: int = 0) -> list[int]:
    """New tokens per request of the steady load: uniform in ``steady_range``, the same for every
    mode (request i always asks for the same length), so requests finish at different rounds in
    AR decoding too, as in a server, instead of in lockstep waves."""
    lo, hi = steady_range(gen_len)
    return np.random.default_rng(seed).integers(lo, hi + 1, n).tolist()


def request_seed(run_seed: int, i: int) -> int:
    """Request i's sampling seed, the same in every mode: the synthetic acceptance is keyed by
    seed and position, so modes whose rounds agree see the same outcomes (common random numbers:
    the modes' difference is not buried in acceptance noise, +-10 % between runs of 16 requests)."""
    return (run_seed << 20) + i


def steady_state(llm, prompts: np.ndarray, concurrency: int, gen_len: int, speculative: bool,
                 verify_mode: str = "fixed", seed: int = 0) -> dict:
    """Greedy decoding at ``concurrency`` requests in flight over the prompt pool ``prompts``
    [R, T] (R > concurrency), request i asking for ``steady_lengths(R, gen_len)[i]`` tokens: a
    finished request is replaced by the next prompt at once; tokens/s (the new requests' prefill
    included in the time, their first token in the tokens) over the rounds from the first
    replacement to the submission of the last prompt."""
    from dspark_trt.runtime import SamplingParams
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, verify_mode=verify_mode, seed=request_seed(seed, i))
              for i, n in enumerate(steady_lengths(len(prompts), gen_len))]
    gen = llm.scheduler(speculative)
    seqs = [gen.add_request(p.tolist(), sp) for p, sp in zip(prompts[:concurrency], params)]
    nxt, t0, rounds, out0 = concurrency, None, 0, 0
    gen.round_log = []
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    while nxt < len(prompts):
        done = gen.step()
        if t0 is not None:
            rounds += 1
        for _ in done:
            if nxt == len(prompts):
                break
            if t0 is None:                   # the window opens at the first replacement
                sync()
                t0, out0 = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
                gen.round_log = []
                p_calls, p_seqs, p_s = gen.prefill_calls, gen.prefill_seqs, gen.prefill_seconds
            seqs.append(gen.add_request(prompts[nxt].tolist(), params[nxt]))
            nxt += 1
    sync()
    dt = time.perf_counter() - t0
    prefill = (gen.prefill_calls - p_calls, gen.prefill_seqs - p_seqs, gen.prefill_seconds - p_s)
    tokens = sum(len(s.output_ids) for s in seqs) - out0
    d = gen.deferred        # the AR fallback's deferred draft context, the whole run up to here
    deferred = {"flushes": d.flushes, "rows_written": d.flushed_rows, "prompts_deferred": d.prompts_deferred,
                "prompt_rows_never_written": d.prompt_rows_dropped}   # (runtime/deferred_context.py)
    for s in seqs:
        gen.abort(s.request_id)
    gen.step()
    return {**bench.decode_stats(seqs, tokens, rounds, dt),
            # a decode instance of a prefill / decode-disaggregated deployment: the admissions'
            # prefill time and the first tokens they sample left out
            "decode_only_tokens_per_s": (tokens - prefill[1]) / max(dt - prefill[2], 1e-9),
            "requests_submitted": len(seqs), "window_tokens": tokens,
            "prefill_calls": prefill[0], "prefill_requests": prefill[1],
            "prefill_ms_per_call": 1e3 * prefill[2] / max(prefill[0], 1),
            "prefill_share": prefill[2] / dt, "round_wall": round_wall(gen.round_log),
            "deferred_context": deferred}


def round_wall(log: list[tuple[str, int, float]]) -> dict:
    """The window's rounds as the Scheduler timed them (``Scheduler.round_log``), per kind: count,
    mean / median / max wall ms and mean rows (the prefills are not in them)."""
    by_kind: dict[str, list] = {}
    for kind, rows, ms in log:
        by_kind.setdefault(kind, []).append((rows, ms))
    out = {}
    for kind, v in sorted(by_kind.items()):
        rows, ms = np.array(v, dtype=np.float64).T
        out[kind] = {"count": len(ms), "mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
                     "max_ms": float(ms.max()), "mean_rows": float(rows.mean())}
    return out


def repeated(runs: list[dict]) -> dict:
    """A mode's record at one batch over its repeats: the median run's (by tokens/s; the lower
    middle one of an even count), with every run's tokens/s."""
    order = sorted(runs, key=lambda r: r["decode_tokens_per_s"])
    rec = dict(order[(len(order) - 1) // 2])
    if len(runs) > 1:
        rec["decode_tokens_per_s_repeats"] = [r["decode_tokens_per_s"] for r in runs]
    return rec


def paired_ratios(runs: list[dict], refs: list[dict], key: str = "decode_tokens_per_s") -> list[float]:
    """tokens/s (``key``) of each repeat over the reference's in the same repeat; [] where a run
    lacks it."""
    if not all(key in r for r in (*runs, *refs)):
        return []
    return [a[key] / b[key] for a, b in zip(runs, refs)]


def run(argv) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    sizes = bench._ints(args.batch_sizes)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES + tuple(EXTRA_MODES)]
    if unknown or "fixed" not in modes:
        raise SystemExit(f"error: --modes {args.modes!r}: "
                         + (f"unknown {unknown} (choose from {list(MODES + tuple(EXTRA_MODES))})" if unknown
                            else "must include 'fixed', the reference every mode is compared with"))
    steady = args.load == "steady"
    longest = steady_range(args.gen_len)[1] if steady else args.gen_len
    args.max_batch_size, args.max_seq_len = max(sizes), args.prompt_len + longest
    if args.model and not (args.checkpoint or args.engine) and not args.random_weights:
        raise SystemExit("error: --model without checkpoints is RANDOM weights: add --random-weights")
    if args.profile_kinds and not (args.round_kinds and torch.cuda.is_available()):
        raise SystemExit("error: --profile-kinds profiles the --round-kinds rounds on a CUDA GPU: add "
                         "--round-kinds" + ("" if torch.cuda.is_available() else " and run it where a GPU is"))
    llm = bench.load_llm(args, **bench.step_path_kwargs(args))   # --compile / --unfused
    if args.synthetic:
        llm.networks = SyntheticAcceptance(llm.networks, survival_curve(args.synthetic), args.spread)
        llm._steps = None                       # the steps are built over the wrapped networks
    curve = load_prices(args.prices) if args.prices else measure_cost_curve(llm, args, sizes)
    from dspark_trt.runtime.confidence import Calibration
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    n = llm.networks.num_spec_tokens
    calibration = (Calibration([1.0], {"survival": survival_curve(args.synthetic)}) if args.synthetic
                   else llm.calibration)          # replayed confidences are calibrated by construction
    llm.steps.eager.scheduler = VerifyScheduler(n, llm.max_batch_size * (n + 1), llm.device,
                                                calibration, curve, cost_model=llm.cost_model,
                                                learn_costs=args.learn_round_costs)
    llm.verify_cost = curve
    for spec in (True, False):               # the steady load's admissions replay prefill graphs
        llm.capture_graphs(spec, prefill_lengths=[args.prompt_len] if steady else None)
    requests = lambda B: max(B * max(2, args.waves), B + 1, args.min_requests)  # noqa: E731 (steady)
    pool = max(requests(B) for B in sizes) if steady else max(sizes)
    prompts_all = bench.make_prompts(llm, args.prompts, pool, args.prompt_len, args.seed)
    rows = {}

    sched = llm.steps.eager.scheduler
    trimmed = sched.configured

    def decode(B, speculative, mode="fixed"):
        mode, sched.cost_model = EXTRA_MODES.get(mode, (mode, trimmed))
        if sched.configured != trimmed:
            llm.capture_graphs(True)                  # the packed verify's slot graphs
        if steady:
            return steady_state(llm, prompts_all[:requests(B)], B, args.gen_len, speculative, mode, args.seed)
        return bench.end_to_end(llm, prompts_all[:B], args.gen_len, speculative, mode, request_seed(args.seed, 0))

    kinds_survival = (args.round_kinds and {"scheduled", "packed", "auto"} & set(modes)
                      and ((args.synthetic and survival_curve(args.synthetic)) or [0.5 ** (k + 1) for k in range(n)]))

    def spec_run(B, mode):
        """One speculative run of ``mode`` at B with its verify-window counters."""
        for counter in (llm.steps.verify_widths, llm.steps.verify_slots, llm.steps.window_rounds):
            counter.clear()
        e2e = decode(B, True, mode)
        widths = dict(llm.steps.verify_widths)
        e2e["verify_windows"] = {str(w): c for w, c in sorted(widths.items())}
        e2e["verify_slots"] = {str(t): c for t, c in sorted(llm.steps.verify_slots.items())}
        e2e["window_rounds"] = {str(w): c for w, c in sorted(llm.steps.window_rounds.items())}
        e2e["confidence_rounds"] = sum(widths.values())   # the others: fixed or window rounds
        narrow = llm.steps.verify_widths + llm.steps.window_rounds      # Counters: rounds per window
        rounds = sum(narrow.values())
        e2e["mean_verify_window"] = (sum(w * c for w, c in narrow.items()) / rounds if rounds else n)
        return e2e

    for B in sorted(sizes):
        runs = {m: [] for m in (*modes, "autoregressive")}
        order = (*modes, "autoregressive")
        for rep in range(max(1, args.repeats)):            # interleaved: each repeat runs every mode once,
            for mode in order[rep % len(order):] + order[:rep % len(order)]:     # in a rotated order
                runs[mode].append(decode(B, False) if mode == "autoregressive" else spec_run(B, mode))
        row = {m: repeated(rs) for m, rs in runs.items()}
        for mode in modes:
            for ref in ("fixed", "autoregressive"):      # steady: also the decode rounds alone (no prefills)
                row[mode][f"ratio_vs_{ref}_repeats"] = paired_ratios(runs[mode], runs[ref])
                row[mode][f"decode_only_ratio_vs_{ref}_repeats"] = paired_ratios(
                    runs[mode], runs[ref], "decode_only_tokens_per_s")
        for r in row.values():
            r.pop("output_ids_row0", None)
        fixed = row["fixed"]["decode_tokens_per_s"]
        for mode in modes:
            row[mode]["speedup_vs_fixed"] = row[mode]["decode_tokens_per_s"] / fixed
            row[mode]["speedup_vs_autoregressive"] = (row[mode]["decode_tokens_per_s"]
                                                      / row["autoregressive"]["decode_tokens_per_s"])
        if kinds_survival:
            row["round_kinds"] = round_kinds(llm, args, B, kinds_survival, packed=bool({"packed", "auto"} & set(modes)),
                                             profile=args.profile_kinds)
        rows[str(B)] = row
        print(f"[verify-concurrency] B={B:3d} " + " | ".join(
            f"{m} {r['decode_tokens_per_s']:.0f} tok/s"
            + (f" ({r['decode_only_tokens_per_s']:.0f} decode-only)" if "decode_only_tokens_per_s" in r else "")
            + f" v/r {r.get('verified_per_round') or 1:.2f}"
            for m, r in row.items() if m != "round_kinds"), flush=True)
        print(f"[verify-concurrency] B={B:3d} round wall ms (mean / max, count): " + " | ".join(
            f"{m}: " + ", ".join(f"{k} {v['mean_ms']:.2f} / {v['max_ms']:.1f} ({v['count']})"
                                 for k, v in r.get("round_wall", {}).items())
            for m, r in row.items() if m != "round_kinds"), flush=True)
        if args.repeats > 1:
            print(f"[verify-concurrency] B={B:3d} paired ratios per repeat: " + " | ".join(
                f"{m}/fixed " + " ".join(f"{v:.2f}" for v in row[m]["ratio_vs_fixed_repeats"])
                + f", {m}/AR " + " ".join(f"{v:.2f}" for v in row[m]["ratio_vs_autoregressive_repeats"])
                + (" (decode alone: /fixed " + " ".join(
                    f"{v:.2f}" for v in row[m]["decode_only_ratio_vs_fixed_repeats"]) + ", /AR " + " ".join(
                    f"{v:.2f}" for v in row[m]["decode_only_ratio_vs_autoregressive_repeats"]) + ")"
                   if row[m]["decode_only_ratio_vs_fixed_repeats"] else "")
                for m in modes if m != "fixed"), flush=True)
        if "round_kinds" in row:
            kinds = row["round_kinds"]
            print(f"[verify-concurrency] B={B:3d} round ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in kinds.items() if k != "profiles"), flush=True)
            for k, p in kinds.get("profiles", {}).items():
                print(f"[verify-concurrency] B={B:3d} {k} round: wall {p['wall_us'] / 1e3:.2f} ms, kernels "
                      f"{p['kernel_us_per_call'] / 1e3:.2f} ms ({p['kernels_per_call']:.0f}); top: " + ", ".join(
                          f"{t['name'][:40]} {t['us_per_call'] / 1e3:.2f}" for t in p["top"][:6]), flush=True)
    cuda = llm.device.type == "cuda"
    tps = lambda b, m: rows[b][m]["decode_tokens_per_s"]  # noqa: E731
    goal = {}
    for m in ("scheduled", "packed", "auto"):
        if {m, "fixed"} <= set(modes):
            goal.update({f"{m}_ge_fixed_every_batch": all(tps(b, m) >= tps(b, "fixed") for b in rows),
                         f"{m}_ge_autoregressive_every_batch": all(
                             tps(b, m) >= tps(b, "autoregressive") for b in rows),
                         f"{m}_over_fixed_at_largest_batch": tps(str(max(sizes)), m) / tps(str(max(sizes)), "fixed"),
                         **({f"{m}_over_fixed_at_largest_batch_decode_only":
                             rows[str(max(sizes))][m]["decode_only_tokens_per_s"]
                             / rows[str(max(sizes))]["fixed"]["decode_only_tokens_per_s"]} if steady else {}),
                         "bound_at_batch_64": 1.2})
            if args.repeats > 1:              # paired per repeat: the medians of the ratios
                goal[f"{m}_over_autoregressive_median_paired"] = {
                    b: float(np.median(rows[b][m]["ratio_vs_autoregressive_repeats"])) for b in rows}
                goal[f"{m}_over_fixed_median_paired"] = {
                    b: float(np.median(rows[b][m]["ratio_vs_fixed_repeats"])) for b in rows}
    start = llm.steps.eager.scheduler.calibration.survival(n)
    start = None if start is None else start.tolist()
    return {
        "git_sha": provenance.git_sha(), "command": "python benchmarks/verify_concurrency.py " + " ".join(argv),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "model": {"preset": args.model, "checkpoint": args.checkpoint, "random_weights": bool(args.random_weights),
                  "dtype": str(llm.networks.dtype), "num_spec_tokens": n,
                  "target_layers": llm.pair.target.num_hidden_layers, "hidden": llm.pair.target.hidden_size,
                  "step_path": bench.eager_path(llm)},
        "confidence": (f"synthetic, replayed from {args.synthetic} (spread {args.spread})" if args.synthetic
                       else "the draft's confidence head" + (" (calibrated)" if llm.calibration else "")),
        "acceptance": "synthetic (same file)" if args.synthetic else "measured (greedy verification)",
        "starting_survival": start,           # a fresh scheduler's estimate before any round
        "cost_curve": curve.to_json(), "cost_model": llm.steps.eager.scheduler.configured,
        "options": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "prompts": args.prompts, "gen_len": args.gen_len, "prompt_len": args.prompt_len,
        "load": (f"steady: B requests in flight, replaced as they finish, max({max(2, args.waves)} x B, "
                 f"{args.min_requests}) submitted, new tokens per request uniform in [gen_len / 2, 3 gen_len / 2]; tokens/s "
                 "from the first replacement to the last submission"
                 if steady else "static: one batch of B requests, until the last one ends"),
        "batch": rows, "goal_issue_25": goal, "seconds": time.perf_counter() - t0,
        "notes": ["verified_per_round: drafts each request verified per round + 1 (its anchor)",
                  "mean_verify_window: drafts per row the confidence rounds' and window rounds' "
                  "verify ran (trimmed window), averaged over those rounds (confidence_rounds ran "
                  "the head and the admission, window_rounds only the window's drafts); N when none "
                  "ran (fixed rounds); AR fallback rounds verify 0 drafts and count in "
                  "verified_per_round only",
                  "decode_tokens_per_s: static load, the prefill step excluded; steady load, the "
                  "window's admission prefills included (prefill_share of the time)",
                  "decode_only_tokens_per_s (steady load): the admission prefills' time and their "
                  "first tokens left out, as a decode instance of a prefill / decode-disaggregated "
                  "deployment sees the load"],
    }


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bs = sorted(int(b) for b in report["batch"])
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = {"autoregressive": "k", "fixed": "C0", "scheduled": "C1", "threshold": "C2", "packed": "C3", "auto": "C4"}
    for mode, style in (("autoregressive", "--"), ("fixed", "o-"), ("scheduled", "s-"), ("threshold", "^-"),
                        ("packed", "D-"), ("auto", "v-")):
        if mode not in report["batch"][str(bs[0])]:
            continue
        tps = [report["batch"][str(x)][mode]["decode_tokens_per_s"] for x in bs]
        a.plot(bs, tps, style, color=colors[mode], label=mode if mode != "fixed" else f"fixed N={report['model']['num_spec_tokens']}")
        if mode != "autoregressive":
            b.plot(bs, [report["batch"][str(x)][mode]["verified_per_round"] for x in bs], style,
                   color=colors[mode], label=f"{mode}: verified / request")
            if mode == "scheduled":
                w = [report["batch"][str(x)][mode]["mean_verify_window"] for x in bs]
                b.plot(bs, [None if v is None else v + 1 for v in w], "s:", color="C1", mfc="none", label="scheduled: verify window + 1")
    title = f"{report['gpu']}, {report['model']['preset'] or report['model']['checkpoint'] or 'default pair'}"
    a.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="decode tokens/s", title=title)
    b.set(xscale="log", xlabel="concurrent requests", ylabel="tokens per request per round",
          title="verified tokens per request per round" + (" (synthetic)" if "synthetic" in report["confidence"] else ""))
    rows = [report["batch"][str(x)] for x in bs]
    for mode, marker in (("scheduled", "s"), ("packed", "D"), ("auto", "v"), ("autoregressive", None)):
        for key, suffix, ls in (("decode_tokens_per_s", "", "-"), ("decode_only_tokens_per_s", ", decode only", ":")):
            if mode in rows[0] and key in rows[0][mode]:        # decode only: dotted, open markers
                c.plot(bs, [r[mode][key] / r["fixed"][key] for r in rows], marker=marker, color=colors[mode],
                       ls="--" if mode == "autoregressive" and ls == "-" else ls,
                       mfc="none" if ls == ":" else colors[mode], label=mode + suffix)
    c.axhline(1.0, color="C0", lw=0.8)
    c.axhline(1.2, color="grey", lw=0.8, ls=":", label="issue goal at 64 (1.2x)")
    c.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s over fixed N", title="over fixed N")
    for ax in (a, b, c):
        ax.set_xticks(bs, [str(x) for x in bs])
        ax.minorticks_off()                       # log axes: only the batch sizes are labelled
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plot"]:                      # re-plot a JSON: --plot FILE.json
        path = Path(argv[1])                        # .json or .json.gz
        print(plot(read_json(path), Path(str(path).removesuffix(".gz")).with_suffix(".png")))
        return 0
    report = run(argv)
    out_dir = Path(parse_args(argv).out_dir)
    tag = parse_args(argv).tag or report["gpu"].replace(" ", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    load = "-steady" if parse_args(argv).load == "steady" else ""
    path = out_dir / f"verify-concurrency-{tag}{load}-{report['git_sha']}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"[verify-concurrency] wrote {path} and {plot(report, path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
