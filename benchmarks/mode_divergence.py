"""Where an all-``scheduled`` request's rounds part from the fixed mode's (issue #25, batch 1).

Session 43 (H100, default pair, batch 1): the scheduled run accepted fewer drafts than the CPU's
from its first request on, before any AR round, while the fixed modes of both machines ran the same
rounds. This loads the pair as ``fallback_trace.py`` does (``bench``'s options, CUDA graphs), runs
the same requests one after another on one scheduler per variant, greedy, and reports for each
variant and request the first round whose verified or accepted drafts differ from the fixed mode's
(only the rounds before the request's first AR round count; the outputs must be equal, lossless):

  fixed            the reference
  scheduled        LLM's default mode (the survival estimate's host work beside each round)
  no-host-work     scheduled, each round's host work (the next round's decisions) after its read-back
  eager            scheduled through the eager steps (no CUDA graphs)
  fixed-host-work  fixed, with the scheduled mode's host work beside each round (its verdicts unused)

``--prices FILE`` replays a run's cost curve (as the trace did); without it a flat verify under
which every window but N loses and AR never wins, so every scheduled round is a fixed round.
Writes ``mode-divergence-[<tag>-]<gpu>-<sha>.json``.

    python benchmarks/mode_divergence.py [--prices RESULT.json.gz] [--requests 4] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime import SamplingParams  # noqa: E402
from priced_pair import DRAFTING_PAYS as FLAT, priced_pair, prompts as pair_prompts  # noqa: E402

VARIANTS = ("fixed", "scheduled", "no-host-work", "eager", "fixed-host-work")


def patched(gen, variant: str):
    """``gen`` set up as ``variant`` -> its requests' verify mode."""
    if variant == "no-host-work":            # each round's host work once its read-back is done
        steps = gen.steps

        def after(fn):
            def round_then_work(*args, host_work=None, **kw):
                out = fn(*args, **kw)
                if host_work is not None:    # before the round's outcome is added: what it saw beside the device
                    host_work()
                return out
            return round_then_work
        gen.steps = _Override(steps, spec_round=after(steps.spec_round),
                              spec_round_admitted=after(steps.spec_round_admitted))
    elif variant == "eager":
        gen.steps = gen.steps.eager
    elif variant == "fixed-host-work":       # the scheduled mode's host work (its verdicts unused)
        decide = gen._next_decisions
        gen._next_decisions = lambda seqs, estimates: decide(seqs, True)
    return "fixed" if variant.startswith("fixed") else "scheduled"


class _Override:
    """``inner`` with some attributes replaced."""

    def __init__(self, inner, **attrs):
        self._inner, self._attrs = inner, attrs

    def __getattr__(self, name):
        return self._attrs[name] if name in self._attrs else getattr(self._inner, name)


def run_variant(llm, prompts, variant: str, gen_len: int) -> list[dict]:
    """Each request's output, verified and accepted drafts per round, and round kinds; request i
    asks for as many tokens as in ``verify_concurrency``'s steady load (``steady_lengths``)."""
    gen = llm.scheduler(True)
    mode = patched(gen, variant)
    out = []
    for p, n in zip(prompts, vc.steady_lengths(len(prompts), gen_len)):
        seq = gen.add_request(p.tolist(), SamplingParams(max_new_tokens=n, ignore_eos=True, verify_mode=mode))
        kinds = []
        while gen.has_work():
            gen.step()
            kinds.append(gen._round_kind)
        out.append({"output": seq.output_ids, "proposed": seq.stats.proposed, "accepted": seq.stats.accepted,
                    "kinds": [k for k in kinds if k]})
    return out


def divergence(ref: dict, run: dict) -> dict:
    """The first round (before the run's first AR round) whose drafts differ from ``ref``'s."""
    first_ar = run["proposed"].index(0) if 0 in run["proposed"] else len(run["proposed"])
    pairs = list(zip(zip(ref["proposed"], ref["accepted"]), zip(run["proposed"], run["accepted"])))[:first_ar]
    at = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
    return {"same_output": ref["output"] == run["output"], "rounds_compared": len(pairs), "first_diff": at,
            "ref_accepted": ref["accepted"][at:at + 6] if at is not None else None,
            "run_accepted": run["accepted"][at:at + 6] if at is not None else None,
            "accepted_sum_compared": [sum(a for (_, a), _ in pairs), sum(b for _, (_, b) in pairs)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prices", default=None, help="a run's cost curve (verify_concurrency JSON); default: FLAT")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--gen-len", type=int, default=64, help="requests ask for gen_len / 2 .. 3 gen_len / 2 tokens")
    ap.add_argument("--dtype", default=None, help="e.g. bf16 on the CPU (the GPU's default)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"error: unknown variants {sorted(unknown)} (choose from {VARIANTS})")
    llm = priced_pair(vc.load_prices(a.prices) if a.prices else FLAT, 1, a.gen_len, dtype=a.dtype)
    prompts = pair_prompts(llm, a.requests)
    runs = {v: run_variant(llm, prompts, v, a.gen_len) for v in ["fixed"] + [v for v in variants if v != "fixed"]}
    gpu = provenance.gpu_name() if llm.device.type == "cuda" else "cpu"
    report = {"git_sha": provenance.git_sha(), "gpu": gpu, "prices": a.prices or FLAT.source, "tag": a.tag,
              "command": "python benchmarks/mode_divergence.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "variants": {}}
    for v, run in runs.items():
        diffs = [divergence(ref, r) for ref, r in zip(runs["fixed"], run)]
        kinds = sorted({k for r in run for k in r["kinds"]})
        report["variants"][v] = {"requests": diffs, "round_kinds": kinds,
                                 "accepted_per_request": [r["accepted"] for r in run]}
        print(f"[mode-divergence] {gpu} {v}: kinds {kinds}; first differing round per request "
              f"{[d['first_diff'] for d in diffs]}; accepted (fixed, this) "
              f"{[d['accepted_sum_compared'] for d in diffs]}; same output {all(d['same_output'] for d in diffs)}; "
              f"first rounds' accepted {[r['accepted'][:8] for r in run]}", flush=True)
    path = provenance.result_path(a.out_dir, "mode-divergence", gpu, a.tag)
    path.write_text(json.dumps(report))
    print(f"[mode-divergence] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
