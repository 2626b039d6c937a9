"""Where a steady-load round's host time goes (issue #25): ``verify_concurrency.py``'s runs with
the Scheduler's own functions and the AR steps timed call by call.

Wraps ``Scheduler._falls_back_to_ar`` / ``_ar_round`` / ``_reserve_round`` / ``_write_deferred``
(... ``TIMED``), each round's ``host_work`` (and how often the device had finished
before it did: ``host_work.device_idle``'s mean is that share), the steps' rounds (``DecodeSteps``; ``GraphedSteps`` with CUDA graphs) and
``SurvivalEstimate.add`` / ``prepare`` (the latter runs inside a round, before its read-back) with
wall timers, runs ``verify_concurrency.run``
with the given arguments (its own JSON is not written), and writes per batch and mode the calls
and mean ms of each, next to the rounds' walls: e.g. the AR fallback's bookkeeping is
``_ar_round`` minus ``ar_round_keep_taps`` against plain AR's ``_ar_round`` minus ``ar_round``, and a
speculative round's ``_spec_round`` minus ``DecodeSteps.spec_round`` in either mode.
``--force-speculative``: ``VerifyScheduler.prefers_ar`` always False, so the scheduled mode's rounds
stay speculative where the cost curve would fall back to AR (the CPU): what its decisions cost a
round of the kind the H200 runs.

    python benchmarks/scheduler_overheads.py --device cpu --prompts heldout --batch-sizes 4,64 \\
        --gen-len 32 --prompt-len 64 --load steady --waves 3 --modes fixed,scheduled --out-dir DIR
"""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import verify_concurrency as vc  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime import cuda_graphs, deferred_context, scheduler as sched_mod, steps as steps_mod, \
    survival as survival_mod, verify_scheduler as verify_scheduler_mod  # noqa: E402

TIMED = {sched_mod.Scheduler: ("_falls_back_to_ar", "_ar_round", "_reserve_round", "_write_deferred", "_spec_round",
                                "_observe_round", "_estimates_rounds", "_estimated_window", "round_inputs"),
         steps_mod.DecodeSteps: ("ar_round", "ar_round_keep_taps", "spec_round"),
         cuda_graphs.GraphedSteps: ("spec_round", "spec_round_admitted", "ar_round", "ar_round_keep_taps"),
         deferred_context.DeferredContext: ("add", "flush"),
         survival_mod.SurvivalEstimate: ("add", "prepare")}
PREFIX = {deferred_context.DeferredContext: "deferred."}      # names the timed classes share


def timed(calls: dict):
    """Wrap the TIMED methods so that each call's wall ms lands in ``calls[name]``."""
    for cls, names in TIMED.items():
        for name in names:
            fn = getattr(cls, name)
            label = PREFIX.get(cls, "") + name

            @functools.wraps(fn)
            def wrapper(*a, _fn=fn, _name=label, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    calls.setdefault(_name, []).append(1e3 * (time.perf_counter() - t0))
            setattr(cls, name, wrapper)


def timed_host_work(calls: dict) -> None:
    """Time each round's ``host_work`` (``run_host_work``, between the queued device work and the
    read-back) and count in ``host_work.device_idle`` the calls after which the device had already
    finished (a CUDA stream with nothing left): there the host work was on the round's path, not
    beside it."""
    fn = steps_mod.run_host_work

    def wrapper(work):
        if work is None:
            return fn(work)
        t0 = time.perf_counter()
        fn(work)
        calls.setdefault("host_work", []).append(1e3 * (time.perf_counter() - t0))
        if torch.cuda.is_available():
            idle = torch.cuda.current_stream().query()
            calls.setdefault("host_work.device_idle", []).append(float(idle))
    steps_mod.run_host_work = cuda_graphs.run_host_work = wrapper


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    forced = "--force-speculative" in argv
    if forced:          # the scheduled mode's rounds stay speculative: its decisions' host cost on a
        argv = [a for a in argv if a != "--force-speculative"]        # machine whose curve says AR
        verify_scheduler_mod.VerifyScheduler.prefers_ar = lambda self, rows, survival, margin=0.0: False
    calls: dict[str, list[float]] = {}
    rows = []
    steady = vc.steady_state

    def measured(llm, prompts, B, gen_len, speculative, mode="fixed", seed=0):
        calls.clear()
        r = steady(llm, prompts, B, gen_len, speculative, mode, seed)
        rows.append({"batch": B, "mode": mode if speculative else "autoregressive",
                     "decode_tokens_per_s": r["decode_tokens_per_s"], "round_wall": r["round_wall"],
                     "calls": {k: {"count": len(v), "mean_ms": sum(v) / len(v)} for k, v in calls.items()}})
        print(f"[overheads] B={B} {rows[-1]['mode']}: " + ", ".join(
            f"{k} {v['count']} x {v['mean_ms']:.3f} ms" for k, v in rows[-1]["calls"].items()), flush=True)
        return r

    timed(calls)
    timed_host_work(calls)
    vc.steady_state = measured
    vc.run(argv)
    gpu = provenance.gpu_name()
    path = provenance.result_path(vc.parse_args(argv).out_dir, "scheduler-overheads", gpu)
    path.write_text(json.dumps({"git_sha": provenance.git_sha(), "gpu": gpu,
                                "command": "python benchmarks/scheduler_overheads.py " + " ".join(argv)
                                + (" --force-speculative" if forced else ""),
                                "rows": rows}, indent=1))
    print(f"[overheads] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
