"""Where an all-``scheduled`` batch held in AR fallback rounds loses to plain AR decoding (issue #25).

Session 42 (H100, default pair, batch 1, steady load): the fallback's AR rounds took 0.291 ms against
plain AR rounds' 0.275, and its 3 probes 2.64 ms each against fixed rounds' 0.64, together 7 % of
the run. This runs ``verify_concurrency``'s steady load at one batch size, per mode ("ar":
plain AR rounds, "scheduled": LLM's default) a warm-up run, then one under cProfile, and prints per round the host
functions' time of each. Then, on a GPU:
  ``step_walls``      the graphed steps alone (``ar_round`` against ``ar_round_keep_taps``, the
                      fallback's AR step); ``--recapture``: again after both graphs are captured anew;
  ``store_variants``  AR-step graphs that store the taps differently, captured here on one bucket;
  ``graph_kernels``   the kernels of both graphed steps and of a fixed round (torch.profiler);
  ``flush``           deferred-context flushes of 16 and ``--flush-rows`` rows (wall and device
                      time), through the ``ContextRows`` graphs and eagerly.
Writes ``fallback-profile-<gpu>-<sha>.json``.

    python benchmarks/fallback_profile.py --prices RESULT.json.gz [--batch 1] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.commands import bench  # noqa: E402
from dspark_trt.runtime.context_rows import ContextRows  # noqa: E402
from priced_pair import priced_pair, prompts as pair_prompts  # noqa: E402

WATCH = ("step", "_ar_round", "_spec_round", "_falls_back_to_ar", "_estimates_rounds", "round_inputs",
         "add", "room_for", "flush", "draft_context", "_write_deferred", "_observe_round", "commit",
         "_replay_ar", "_replay_round", "fill", "upload", "download", "launch", "get", "prefers_ar",
         "record", "_reserve_round")


def profiled_run(llm, prompts, B: int, gen_len: int, speculative: bool) -> dict:
    """One steady-load run under cProfile -> {rounds, round kinds, per-function ms per round}."""
    prof = cProfile.Profile()
    prof.enable()
    out = vc.steady_state(llm, prompts, B, gen_len, speculative, "scheduled")
    prof.disable()
    rounds = sum(k["count"] for k in out["round_wall"].values())
    funcs = {}
    for (file, line, name), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        if name in WATCH and ("dspark_trt" in file or "verify_concurrency" in file):
            key = f"{Path(file).name}:{line}:{name}"
            funcs[key] = {"calls": nc, "tottime_ms": 1e3 * tt, "cumtime_ms": 1e3 * ct,
                          "cum_us_per_round": 1e6 * ct / max(rounds, 1)}
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:25]
    return {"round_wall": out["round_wall"], "decode_only_tokens_per_s": out["decode_only_tokens_per_s"],
            "deferred_context": out["deferred_context"], "rounds": rounds, "functions": funcs,
            "top_tottime": [{"function": f"{Path(f).name}:{ln}:{n}", "calls": v[1], "tottime_ms": 1e3 * v[2]}
                            for (f, ln, n), v in top]}


@contextmanager
def prefilled(llm, prompts, B: int):
    """(the next round's inputs of B prefilled requests, a store row per row; the batch's
    modifiers); the requests are aborted after."""
    gen = llm.scheduler(True)
    seqs = [gen.add_request(p.tolist(), bench._greedy(8)) for p in prompts[:B]]
    gen.step()
    r = gen.round_inputs(seqs)
    r.tap_row = np.arange(B, dtype=np.int64)
    try:
        yield r, gen.constants.get(seqs).mods
    finally:
        for s in seqs:
            gen.abort(s.request_id)
        gen.step()


def interleaved_walls(calls: dict, iters: int, block: int = 50) -> dict:
    """Wall per call of each of ``calls`` (name -> fn), interleaved in blocks of ``block`` calls."""
    walls = {k: [] for k in calls}
    for fn in calls.values():
        for _ in range(20):
            fn()
    for _ in range(iters // block):
        for name, fn in calls.items():
            t = time.perf_counter()
            for _ in range(block):
                fn()
            walls[name].append(1e3 * (time.perf_counter() - t) / block)
    return {k: {"median_ms": float(np.median(v)), "min_ms": float(np.min(v))} for k, v in walls.items()}


def step_walls(llm, prompts, B: int, iters: int = 500, recapture: bool = False) -> dict:
    """Wall per call of the graphed AR step with and without the taps' store (``ar_round`` /
    ``ar_round_keep_taps``), on a prefilled batch, interleaved in blocks of 50; ``recapture``:
    again after both graphs of the batch's bucket are dropped and captured anew, "ar_taps" first
    (``after_recapture``): whether the shipped graphs' capture (at start-up, among the others)
    is what makes "ar_taps" replay slower than a graph of the same step captured later."""
    steps = llm.steps
    with prefilled(llm, prompts, B) as (r, mods):
        calls = {"ar": lambda: steps.ar_round(r, mods), "ar_keep_taps": lambda: steps.ar_round_keep_taps(r, mods)}
        out = interleaved_walls(calls, iters)
        if recapture:
            Bb = steps.bucket(B)
            for key in [k for k in steps._graphs if k[0] in ("ar", "ar_taps") and k[1] == Bb]:
                del steps._graphs[key]
            steps.graph("ar_taps", Bb, mods)
            steps.graph("ar", Bb, mods)
            out["after_recapture"] = interleaved_walls(calls, iters)
    return out


def graph_kernels(llm, prompts, B: int, replays: int = 50, top: int = 30) -> dict:
    """The kernels of the graphed AR step with and without the taps' store, and of a fixed round
    (draft + verify graphs; torch.profiler over ``replays`` replays of each): name -> (count per
    replay, device us per replay)."""
    from torch.profiler import ProfilerActivity, profile
    steps, out = llm.steps, {}
    with prefilled(llm, prompts, B) as (r, mods):
        for name, fn in (("ar", lambda: steps.ar_round(r, mods)),
                         ("ar_keep_taps", lambda: steps.ar_round_keep_taps(r, mods)),
                         ("fixed", lambda: steps.spec_round(r, mods))):
            fn()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    fn()
            rows = [(e.key, e.count / replays, e.device_time_total / replays) for e in prof.key_averages()
                    if e.device_time_total > 0]
            rows.sort(key=lambda x: -x[2])
            out[name] = {"device_us_per_replay": sum(x[2] for x in rows),
                         "kernels_per_replay": sum(x[1] for x in rows),
                         "top": [{"kernel": k[:120], "count": c, "us": u} for k, c, u in rows[:top]]}
    return out


def store_variants(llm, prompts, B: int, blocks: int = 10, per_block: int = 50) -> dict:
    """Wall per replay (fill, upload, launch, read-back) and device time per replay of AR-step graphs
    that store the taps differently, captured on one bucket's buffers: "ar" (no store), "index_put"
    (the shipped "ar_taps" step), "index_copy" (inert rows mapped to the spare row, then
    ``index_copy_``), "taps_out" (the taps an output, no store), interleaved in blocks."""
    g = llm.steps
    with prefilled(llm, prompts, B) as (r, mods):
        g.ar_round_keep_taps(r, mods)                       # the store exists
        graphs = variant_graphs(g, B, mods)
        walls, device = {k: [] for k in graphs}, {k: [] for k in graphs}
        buf = g.buffers(g.bucket(B))
        for _ in range(blocks):
            for name, graph in graphs.items():
                buf.fill(r)
                buf.upload()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(per_block):
                    buf.fill(r)
                    buf.upload()
                    graph.launch()
                    buf.download(graph.outputs, B)
                walls[name].append(1e3 * (time.perf_counter() - t) / per_block)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(per_block):
                    graph.launch()
                e1.record()
                torch.cuda.synchronize()
                device[name].append(e0.elapsed_time(e1) / per_block)
    return {k: {"wall_median_ms": float(np.median(walls[k])), "wall_min_ms": float(np.min(walls[k])),
                "device_median_ms": float(np.median(device[k]))} for k in graphs}


def variant_graphs(g, B: int, mods) -> dict:
    """``store_variants``' graphs of the AR step, captured on the buffers of B's bucket."""
    from dspark_trt.runtime.cuda_graphs import CapturedGraph
    eager, buf, store = g.steps, g.buffers(g.bucket(B)), g.steps.tap_store
    x, spare = buf.inputs, store.shape[0] - 1

    @torch.inference_mode()
    def index_copy():
        nxt, taps = eager.ar_step(x, mods, taps_out=True)
        store.index_copy_(0, torch.where(x.tap_row >= 0, x.tap_row, spare), taps)
        return nxt
    fns = {"ar": lambda: eager.ar_step(x, mods), "index_put": lambda: eager.ar_step(x, mods, keep_taps=True),
           "index_copy": index_copy, "taps_out": lambda: eager.ar_step(x, mods, taps_out=True)[0]}
    graphs = {}
    for name, fn in fns.items():
        buf.fill(None)
        buf.upload()
        graphs[name] = CapturedGraph(fn, g.pool, g.backend, g.capture_stream)
    return graphs


def flush_cost(llm, prompts, rows: int, eager: bool, iters: int = 10) -> dict:
    """Wall and device time of one ``DeferredContext.flush`` of ``rows`` AR rows of one slot
    (``eager``: through eager calls, not the ``ContextRows`` graphs)."""
    gen = llm.scheduler(True)
    seq = gen.add_request(prompts[0].tolist(), bench._greedy(8))
    gen.step()
    d, table = gen.deferred, gen._table([seq])
    if eager:
        d.writer = ContextRows(llm.networks)
    walls, device = [], []
    for i in range(iters + 2):
        for p in range(rows):                # the prompt's positions again (pages it holds)
            d.add([seq.slot], [p % len(prompts[0])])
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        d.flush([seq.slot], table)
        e1.record()
        torch.cuda.synchronize()
        if i >= 2:
            walls.append(1e3 * (time.perf_counter() - t))
            device.append(e0.elapsed_time(e1))
    gen.abort(seq.request_id)
    gen.step()
    w = d.writer
    return {"rows": rows, "eager": eager, "wall_ms": float(np.median(walls)), "events_ms": float(np.median(device)),
            "graph_writes": w.graph_writes, "eager_writes": w.eager_writes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prices", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--flush-rows", type=int, default=160)
    ap.add_argument("--recapture", action="store_true",
                    help="time the graphed AR steps again after capturing their graphs anew (step_walls)")
    ap.add_argument("--max-batch-size", type=int, default=64,
                    help="the LLM's (verify_concurrency: the largest batch size; the deferred rows' pool is 64 per slot)")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    B = a.batch
    llm = priced_pair(vc.load_prices(a.prices), B, a.gen_len, max_batch_size=a.max_batch_size)
    prompts = pair_prompts(llm, max(16, 3 * B))
    report = {"git_sha": provenance.git_sha(), "gpu": provenance.gpu_name(),
              "command": "python benchmarks/fallback_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "batch": B, "gen_len": a.gen_len, "runs": {}}
    for name, spec in (("ar", False), ("scheduled", True)):
        vc.steady_state(llm, prompts, B, a.gen_len, spec, "scheduled")          # warm-up
        report["runs"][name] = profiled_run(llm, prompts, B, a.gen_len, spec)
        r = report["runs"][name]
        print(f"[fallback-profile] {name}: {r['decode_only_tokens_per_s']:.0f} tok/s decode-only, "
              f"round wall {json.dumps(r['round_wall'])}", flush=True)
        for k, v in sorted(r["functions"].items(), key=lambda kv: -kv[1]["cumtime_ms"]):
            print(f"   {k:55s} calls {v['calls']:6d}  cum {v['cum_us_per_round']:8.1f} us/round  "
                  f"tot {v['tottime_ms']:8.2f} ms", flush=True)
    if torch.cuda.is_available():
        report["step_walls"] = step_walls(llm, prompts, B, recapture=a.recapture)
        print(f"[fallback-profile] graphed AR step walls: {json.dumps(report['step_walls'])}", flush=True)
        report["store_variants"] = store_variants(llm, prompts, B)
        for name, v in report["store_variants"].items():
            print(f"[fallback-profile] store variant {name:10s} wall {v['wall_median_ms']:.4f} ms (min "
                  f"{v['wall_min_ms']:.4f}), device {v['device_median_ms']:.4f} ms a replay", flush=True)
        report["graph_kernels"] = graph_kernels(llm, prompts, B)
        for name, g in report["graph_kernels"].items():
            print(f"[fallback-profile] {name}: {g['kernels_per_replay']:.1f} kernels, "
                  f"{g['device_us_per_replay']:.1f} us per replay", flush=True)
            for k in g["top"]:
                print(f"   {k['count']:5.1f} x {k['us']:7.2f} us  {k['kernel']}", flush=True)
        report["flush"] = [flush_cost(llm, prompts, rows, eager) for rows in (16, a.flush_rows) for eager in (False, True)]
        print(f"[fallback-profile] flush: {json.dumps(report['flush'])}", flush=True)
    path = provenance.result_path(a.out_dir, "fallback-profile", report["gpu"])
    path.write_text(json.dumps(report, indent=1))
    print(f"[fallback-profile] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
