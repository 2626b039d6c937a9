"""The Scheduler's own host time per round, its steps stubbed out (issue #25): what a round costs the
host around its device work, on any machine, without the device.

Loads the built-in default pair on the CPU, puts a ``VerifyScheduler`` with the prices of a
``verify_concurrency.py`` result (``--prices``) in front of it, replaces the steps' rounds by stubs that
return tokens at once (no compute, no taps), and times ``Scheduler.step`` over ``--rounds`` rounds per
batch size and mode:
  ``ar``        plain autoregressive rounds (``speculative=False``);
  ``fallback``  an all-``scheduled`` batch held in an AR streak (no probes, no context flushes);
  ``fixed``     speculative fixed-N rounds;
  ``scheduled`` an all-``scheduled`` batch the prices keep speculative.
The host work a round hands its steps (the next round's decisions) runs inline here; on a GPU it runs
while the device works. Writes ``scheduler-host-cost-<sha>.json`` (ms per round, per batch and mode).

    python benchmarks/scheduler_host_cost.py --prices RESULT.json.gz --batch-sizes 1,16,64 --out-dir DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime import LLM, SamplingParams  # noqa: E402
from dspark_trt.runtime.verify_scheduler import VerifyScheduler  # noqa: E402

MODES = {"ar": (False, "fixed"), "fallback": (True, "scheduled"), "fixed": (True, "fixed"),
         "scheduled": (True, "scheduled")}


def stub_steps(llm, n: int, seed: int = 0) -> None:
    """The steps' rounds return tokens at once: AR rounds one per row, speculative rounds
    [accepted, next, drafts] per row with 0-2 accepted."""
    rng = np.random.default_rng(seed)
    steps = llm.steps

    def ar(r, mods, *a, **kw):
        return np.full((r.batch_size, 1), 5, np.int64)

    def spec(r, mods, width=None, host_work=None):
        if host_work is not None:
            host_work()
        return np.concatenate([rng.integers(0, 3, (r.batch_size, 1)), rng.integers(5, 100, (r.batch_size, 1 + n))], 1)
    steps.ar_round = steps.ar_round_keep_taps = ar
    steps.spec_round = spec


def per_round_ms(llm, B: int, mode: str, rounds: int) -> float:
    speculative, verify_mode = MODES[mode]
    gen = llm.scheduler(speculative)
    if mode == "fallback":                               # from the first round: an AR streak
        zeros = np.zeros(gen.nets.num_spec_tokens)                                       # AR wins
        gen._survival.curve = gen._survival.optimistic = lambda: zeros
        gen._probe_every = gen._probe_floor = 10**9      # without probes
        gen.deferred.free = list(range(B * (rounds + 21)))   # and without flushes (the stubs store no
                                                             # taps): a row for each AR round
    elif mode == "scheduled":                            # speculative from the first round
        ones = np.ones(gen.nets.num_spec_tokens)                                         # drafting wins
        gen._survival.curve = gen._survival.optimistic = lambda: ones
    for _ in range(B):
        gen.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=3000, ignore_eos=True, verify_mode=verify_mode))
    for _ in range(20):
        gen.step()
    t = time.perf_counter()
    for _ in range(rounds):
        gen.step()
    ms = (time.perf_counter() - t) / rounds * 1e3
    kinds = {"ar": "ar", "fallback": "ar", "fixed": "fixed", "scheduled": "fixed"}
    if gen._round_kind != kinds[mode]:
        raise SystemExit(f"error: mode {mode} ran {gen._round_kind!r} rounds")
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prices", required=True, help="a verify_concurrency.py result (.json / .json.gz)")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    assets = REPO / "dspark_trt" / "assets" / "default"
    llm = LLM.from_checkpoints(assets / "target", assets / "draft", device="cpu", max_batch_size=max(sizes),
                               max_seq_len=4096)
    n = llm.networks.num_spec_tokens
    llm.steps.eager.scheduler = VerifyScheduler(n, max(sizes) * (n + 1), llm.device, llm.calibration,
                                                vc.load_prices(a.prices))
    stub_steps(llm, n)
    rows = []
    for B in sizes:
        for mode in a.modes.split(","):
            rows.append({"batch": B, "mode": mode, "host_ms_per_round": per_round_ms(llm, B, mode, a.rounds)})
            print(f"[host-cost] B={B:3d} {mode:9s} {rows[-1]['host_ms_per_round']:.3f} ms per round", flush=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scheduler-host-cost-{provenance.git_sha()}.json"
    path.write_text(json.dumps({"git_sha": provenance.git_sha(), "device": "cpu (steps stubbed)",
                                "command": "python benchmarks/scheduler_host_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                "prices": a.prices, "rounds": a.rounds, "rows": rows}, indent=1))
    print(f"[host-cost] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
