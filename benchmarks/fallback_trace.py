"""Why an all-``scheduled`` batch stays in AR rounds (issue #25): one steady-load run at one batch
size with the scheduler's AR-fallback decisions traced round by round.

Session 43 (H100, default pair, batch 1): fixed rounds ran at 1.14x AR and accepted 1.29 drafts a
round, the scheduler's speculative rounds 1.41, yet 674 of its 768 rounds were AR rounds, while the
same prices replayed on the CPU (bf16) gave no AR round at all. Per decision this records the
streak length, the probe interval, the survival estimate's expected accepted drafts (point and
optimistic, ``SurvivalEstimate``), its verified rows and the prior, and the verdict; per
speculative round the drafts accepted. A streak's rounds mostly skip the decision
(``Scheduler._streak_goes_on``): "decisions" are not rounds; ``rows_seen`` lags a deferred ``add``
by one round. At batch 1 (with the prices run's round walls) also request by request
(``per_request``). Writes ``fallback-trace-<gpu>-<sha>.json``.

    python benchmarks/fallback_trace.py --prices RESULT.json [--batch 1] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY  # noqa: E402
from priced_pair import priced_pair, prompts as pair_prompts  # noqa: E402


def traced(gen, log: list) -> None:
    """Wrap ``gen._falls_back_to_ar`` to append each decision's inputs and verdict to ``log``."""
    decide = gen._falls_back_to_ar

    def wrapper(seqs, estimates):
        est = gen._survival
        before = {"streak": gen._ar_streak, "probe_every": gen._probe_every, "probe_floor": gen._probe_floor,
                  "rows_seen": float(est._risk[0]), "window": len(est), "confidence_rounds": len(est.confidence),
                  "history_rows": float(est._hist_risk[0])}
        ar = decide(seqs, estimates)
        log.append({**before, "estimates": bool(estimates), "ar": bool(ar),
                    "point": float(est.curve().sum()), "optimistic": float(est.optimistic().sum()),
                    "prior": [round(float(p), 3) for p in est.prior()],
                    "accepted_last": [int(s.stats.accepted[-1]) if s.stats.accepted else None for s in seqs],
                    "verified_last": [int(s.stats.proposed[-1]) if s.stats.proposed else None for s in seqs],
                    "last_kind": gen._round_kind})
        return ar
    gen._falls_back_to_ar = wrapper


def forced(gen, pattern: tuple[int, int], log: list) -> None:
    """Replace the AR-fallback decision of ``gen`` by ``pattern`` (AR rounds, then speculative
    ones, repeated); each speculative round's place after the AR run and its rows' accepted
    drafts go to ``log`` (read at the next decision)."""
    ar_n, spec_n = pattern
    state = {"i": 0, "pending": None}

    def decide(seqs, estimates):
        if not estimates:                                        # not an all-scheduled batch (fixed N)
            return False
        if state["pending"] is not None:                         # the last speculative round's outcome
            place, rows = state["pending"]
            log.append({"place": place, "accepted": [int(s.stats.accepted[-1]) for s in rows if s.stats.accepted]})
            state["pending"] = None
        k = state["i"] % (ar_n + spec_n)
        state["i"] += 1
        if k < ar_n:
            return True
        state["pending"] = (k - ar_n, list(seqs))
        return False
    gen._falls_back_to_ar = decide
    gen._streak_goes_on = lambda batch: False                    # every round decides


def place_summary(log: list, spec_n: int) -> dict:
    """Mean drafts accepted by the speculative rounds at each place after an AR run."""
    out = {}
    for place in range(spec_n):
        acc = [x for d in log if d["place"] == place for x in d["accepted"]]
        out[place] = {"rounds": len(acc), "mean_accepted": float(np.mean(acc)) if acc else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prices", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-defer", action="store_true",
                    help="AR fallback rounds write the draft context each round (no late writes)")
    ap.add_argument("--eager-replay", action="store_true",
                    help="on the CPU: the rounds through GraphedSteps with its eager-replay backend (the "
                         "CUDA-graph path's static buffers and graph-to-graph outputs, no capture)")
    ap.add_argument("--pattern", default=None, metavar="AR,SPEC",
                    help="force the rounds instead of deciding: AR rounds, then SPEC speculative ones, "
                         "repeated (e.g. 8,8); reports the drafts accepted by the speculative rounds "
                         "by their place after an AR run, against a run of fixed rounds (and its "
                         "accepted drafts per request, in admission order)")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    B = a.batch
    llm = priced_pair(vc.load_prices(a.prices), B, a.gen_len, dtype=a.dtype,
                      graph_backend=EAGER_REPLAY if a.eager_replay else None)
    prompts = pair_prompts(llm, max(16, 3 * B))
    log: list = []
    original = llm.scheduler

    gen_seqs: list = []
    pattern = tuple(int(v) for v in a.pattern.split(",")) if a.pattern else None

    def scheduler(speculative=True):
        gen = original(speculative)
        add = gen.add_request

        def add_request(*args, **kw):
            seq = add(*args, **kw)
            gen_seqs.append(seq)
            return seq
        gen.add_request = add_request
        gen.defer_context = not a.no_defer
        log.clear()
        if pattern:
            forced(gen, pattern, log)
        else:
            traced(gen, log)
        return gen
    llm.scheduler = scheduler
    if pattern:
        return forced_report(llm, prompts, B, a, pattern, log, gen_seqs)
    stats = vc.steady_state(llm, prompts, B, a.gen_len, True, "scheduled")
    walls = round_walls(a.prices, B) if B == 1 else None
    priced, requests = {}, []
    if walls is not None:            # what the decisions are worth at the GPU's walls, against fixed N and AR
        priced["scheduled"] = priced_rate(gen_seqs, walls)
        scheduled_seqs, scheduled_log = list(gen_seqs), list(log)
        gen_seqs.clear()
        vc.steady_state(llm, prompts, B, a.gen_len, True, "fixed")      # (a fresh scheduler clears the log)
        priced["fixed"] = priced_rate(gen_seqs, walls)
        priced["autoregressive"] = {"tokens_per_ms": 1.0 / walls["ar"]}
        requests = per_request(scheduled_seqs, list(gen_seqs), walls)
        gen_seqs[:], log[:] = scheduled_seqs, scheduled_log
    ar = sum(d["ar"] for d in log)                   # decisions (a streak's rounds skip most)
    ar_rounds = sum(s.stats.proposed.count(0) for s in gen_seqs)
    gpu = provenance.gpu_name() if llm.device.type == "cuda" else "cpu"
    report = {"git_sha": provenance.git_sha(), "gpu": gpu, "batch": B, "tag": a.tag,
              "command": "python benchmarks/fallback_trace.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "decode_only_tokens_per_s": stats["decode_only_tokens_per_s"], "tau": stats["tau"],
              "decisions": len(log), "ar_decisions": ar, "ar_rounds_all_requests": ar_rounds,
              "round_walls": walls, "priced": priced, "per_request": requests, "trace": log}
    print(f"[fallback-trace] {a.tag} {gpu}: {len(log)} decisions, {ar} AR (AR rounds of every request, "
          f"warm-up included: {ar_rounds}); tau {stats['tau'] or 0:.3f}; "
          f"{stats['decode_only_tokens_per_s']:.0f} tok/s decode-only (the trace's host work included)", flush=True)
    if priced:
        rate = {k: v["tokens_per_ms"] for k, v in priced.items()}
        print(f"[fallback-trace] priced at the prices run's round walls {walls}: tokens/ms {rate}; scheduled / "
              f"fixed N {rate['scheduled'] / rate['fixed']:.3f}, / AR {rate['scheduled'] / rate['autoregressive']:.3f} "
              f"(AR rounds {priced['scheduled']['ar_rounds']}, speculative {priced['scheduled']['spec_rounds']})",
              flush=True)
    for r in requests:
        print(f"   request {r['request']:2d}: fixed {r['fixed_accepted']:.2f} drafts a round, {r['fixed_ms']:.1f} ms | "
              f"scheduled {r['ar_rounds']} AR + {r['spec_rounds']} speculative, {r['scheduled_ms']:.1f} ms | "
              f"oracle {r['oracle_ms']:.1f} ms  {r['pattern']}", flush=True)
    starts = [i for i, d in enumerate(log) if d["ar"] and d["streak"] == 0]
    print(f"[fallback-trace] streak starts at decisions {starts[:20]}", flush=True)
    for i in starts[:4]:
        for d in log[max(0, i - 2): i + 1]:
            print(f"   {json.dumps({k: d[k] for k in ('streak', 'rows_seen', 'history_rows', 'confidence_rounds', 'point', 'optimistic', 'prior', 'accepted_last', 'ar')})}")
    probes = [d for d in log if d["streak"] > 0 and not d["ar"]]
    median = np.median([d["point"] for d in log if d["ar"]] or [0])
    print(f"[fallback-trace] {len(probes)} probe verdicts that ended a streak; point estimate at AR "
          f"decisions: median {median:.3f}", flush=True)
    write_report(a, "fallback-trace", report)
    return 0


def write_report(a, name: str, report: dict) -> None:
    """``report`` as ``<out-dir>/<name>-[<tag>-]<gpu>-<sha>.json``."""
    path = provenance.result_path(a.out_dir, name, report["gpu"], a.tag)
    path.write_text(json.dumps(report))
    print(f"[fallback-trace] wrote {path}")


def round_walls(prices_path: str, batch: int) -> dict | None:
    """The prices run's measured mean walls (ms) of its AR rounds (scheduled mode) and its fixed
    rounds (fixed mode) at ``batch``, or None where it has no such rounds."""
    try:
        run = vc.read_json(prices_path)["batch"][str(batch)]
        return {"ar": run["scheduled"]["round_wall"]["ar"]["mean_ms"],
                "fixed": run["fixed"]["round_wall"]["fixed"]["mean_ms"]}
    except (KeyError, TypeError):
        return None


def priced_rate(seqs, walls: dict) -> dict:
    """Batch 1: the tokens per ms that these requests' rounds (one request a round) would have run
    at on the prices run's GPU (``round_walls``; prefills aside, this machine's walls aside)."""
    ar = sum(s.stats.proposed.count(0) for s in seqs)
    spec = sum(len(s.stats.proposed) for s in seqs) - ar
    tokens = sum(sum(s.stats.committed) for s in seqs)
    ms = ar * walls["ar"] + spec * walls["fixed"]
    return {"ar_rounds": ar, "spec_rounds": spec, "tokens": tokens, "ms": ms, "tokens_per_ms": tokens / ms if ms else None}


def per_request(scheduled, fixed, walls: dict) -> list[dict]:
    """Batch 1, request by request (admission order, the same prompts in both runs): the fixed
    run's drafts accepted a round and its ms at the prices run's walls, the scheduled run's AR and
    speculative rounds and ms, the better of the two whole-request choices (``oracle_ms``: fixed N,
    or AR for every token), and the scheduled rounds as a string (``A`` an AR round, else the
    drafts accepted, 9 for 9 or more): where a decision lost, e.g. a streak that outlived the hard
    request that started it (session 46)."""
    rows = []
    for i, (s, f) in enumerate(zip(scheduled, fixed)):
        sched, fixed_ms = priced_rate([s], walls), priced_rate([f], walls)["ms"]
        rows.append({"request": i, "fixed_accepted": float(np.mean(fixed_accepted(f) or [0])), "fixed_ms": fixed_ms,
                     "ar_rounds": sched["ar_rounds"], "spec_rounds": sched["spec_rounds"], "scheduled_ms": sched["ms"],
                     "oracle_ms": min(fixed_ms, sum(f.stats.committed) * walls["ar"]),
                     "pattern": "".join("A" if p == 0 else str(min(a, 9))
                                        for a, p in zip(s.stats.accepted, s.stats.proposed))})
    return rows


def fixed_accepted(seq) -> list[int]:
    """The drafts accepted by ``seq``'s speculative rounds (AR rounds verify none)."""
    return [x for x, p in zip(seq.stats.accepted, seq.stats.proposed) if p > 0]


def forced_report(llm, prompts, B: int, a, pattern: tuple[int, int], log: list, gen_seqs: list) -> int:
    """``--pattern``: the forced run, then a run of fixed rounds on the same prompts (every
    request's accepted drafts per round, against the forced run's speculative rounds)."""
    vc.steady_state(llm, prompts, B, a.gen_len, True, "scheduled")
    forced_places = place_summary(log, pattern[1])
    gen_seqs.clear()
    vc.steady_state(llm, prompts, B, a.gen_len, True, "fixed")
    fixed = [x for s in gen_seqs for x in fixed_accepted(s)]
    by_request = [round(float(np.mean(fixed_accepted(s) or [0])), 3) for s in gen_seqs]   # by admission
    gpu = provenance.gpu_name() if llm.device.type == "cuda" else "cpu"
    report = {"git_sha": provenance.git_sha(), "gpu": gpu, "batch": B, "tag": a.tag, "pattern": list(pattern),
              "no_defer": a.no_defer, "command": "python benchmarks/fallback_trace.py " + " ".join(sys.argv[1:]),
              "after_ar_runs": forced_places,
              "fixed_rounds": {"rounds": len(fixed), "mean_accepted": float(np.mean(fixed)) if fixed else None,
                               "per_request": by_request}}
    means = {k: v["mean_accepted"] for k, v in forced_places.items()}
    print(f"[fallback-trace] {a.tag} {gpu} pattern {pattern}: drafts accepted by place after {pattern[0]} AR "
          f"rounds {json.dumps(means)}; fixed rounds {report['fixed_rounds']['mean_accepted']} over {len(fixed)}, "
          f"per request {by_request}", flush=True)
    write_report(a, "fallback-pattern", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
