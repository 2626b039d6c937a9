"""Acceptance table: DSpark vs DFlash (project runtime) vs an autoregressive draft (dense
simulation), at several block sizes, greedy and T = 1, on prompts from the held-out stdlib modules;
plus wall-clock speedup of speculative over plain autoregressive decoding.

    python benchmarks/acceptance.py --run-dir RUN [--device cuda] [--num-prompts 64]

RUN is a ``dspark-trt train`` output (target/, draft/, dflash/, ar_draft/). Writes
benchmarks/results/acceptance-<tag>.json (git sha, device, command) and a markdown table (.md).
tau = mean tokens per round incl. the bonus; acceptance[k] = rounds with > k accepted / rounds.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_trt import LLM, SamplingParams, provenance  # noqa: E402
from dspark_trt.runtime.sampling_params import SpecStats  # noqa: E402
from dspark_trt.train.ar_eval import ar_speculative_generate  # noqa: E402
from dspark_trt.train.batches import encode_files, eval_prompts  # noqa: E402
from dspark_trt.train.checkpoints import load_ar_draft  # noqa: E402
from dspark_trt.train.corpus import HELDOUT, read_stdlib  # noqa: E402
from dspark_trt.train.sources import MANIFEST, Manifest, read_texts  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_prompts(llm: LLM, args) -> tuple[list[list[int]], str]:
    """Prompts from the run's recorded eval split (staged runs: corpus_manifest.json), else from
    the held-out stdlib modules (one-shot runs)."""
    man_path = Path(args.run_dir) / MANIFEST
    if man_path.exists():
        man = Manifest.from_json(man_path.read_text())
        ids = encode_files(llm.tokenizer, read_texts(man, "eval"))
        prompts = eval_prompts(ids, args.num_prompts, args.min_len, args.max_len, seed=args.seed)
        return prompts, man.sha256("eval")
    _, held, manifest = read_stdlib(heldout=HELDOUT)
    ids = encode_files(llm.tokenizer, [f.text for f in held])
    prompts = eval_prompts(ids, args.num_prompts, args.min_len, args.max_len, seed=args.seed)
    return prompts, manifest.heldout_sha256


def summarize(stats: list[SpecStats], seconds: float, tokens: int) -> dict:
    merged = stats[0]
    for s in stats[1:]:
        merged = merged.merge(s)
    d = merged.to_dict()
    taus = [s.tau for s in stats if s.rounds]
    mean = sum(taus) / len(taus) if taus else 0.0
    var = sum((t - mean) ** 2 for t in taus) / (len(taus) - 1) if len(taus) > 1 else 0.0
    d.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds if seconds else 0.0,
             tau_ci95=1.96 * (var / len(taus)) ** 0.5 if taus else 0.0)   # over prompts
    return d


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_runtime(llm: LLM, prompts, temperature: float, args, speculative: bool = True):
    params = [SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens,
                             seed=args.seed + i, ignore_eos=True) for i in range(len(prompts))]
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, speculative=speculative)
    sync(args.device)
    dt = time.perf_counter() - t0
    return outs, dt


def make_llm(run: Path, draft: str, n: int, args) -> LLM:
    return LLM.from_checkpoints(run / "target", run / draft, dtype=DTYPES[args.dtype],
                                device=args.device, num_spec_tokens=n,
                                max_batch_size=max(args.num_prompts, 1),
                                max_seq_len=args.max_len + args.max_new_tokens + 8)


def speed(run: Path, prompts, args, log) -> dict:
    """Batch-1 wall clock: speculative (DSpark, N = the largest swept) vs autoregressive, greedy."""
    n = max(args.num_spec_tokens)
    llm = make_llm(run, "draft", n, args)
    sub = prompts[:args.speed_prompts]
    run_runtime(llm, sub[:1], 0.0, args)            # warm-up
    res = {}
    for mode, spec in (("speculative", True), ("autoregressive", False)):
        total, toks, stats = 0.0, 0, []
        for p in sub:
            outs, dt = run_runtime(llm, [p], 0.0, args, speculative=spec)
            total, toks = total + dt, toks + len(outs[0].output_ids)
            stats.append(outs[0].stats)
        res[mode] = {"seconds": total, "tokens": toks, "tokens_per_s": toks / total}
    res["speedup"] = res["speculative"]["tokens_per_s"] / res["autoregressive"]["tokens_per_s"]
    res.update(batch_size=1, num_spec_tokens=n, prompts=len(sub), temperature=0.0)
    log(f"batch-1 speed (N={n}, greedy, {len(sub)} prompts): speculative "
        f"{res['speculative']['tokens_per_s']:.1f} tok/s, autoregressive "
        f"{res['autoregressive']['tokens_per_s']:.1f} tok/s, speedup {res['speedup']:.2f}x")
    for b in args.speed_batches:                       # whole batches at once (b prompts)
        if b <= 1 or b > len(prompts):
            continue
        batch = prompts[:b]
        run_runtime(llm, batch, 0.0, args)              # warm-up (graphs of this bucket)
        tps = {}
        for mode, spec in (("speculative", True), ("autoregressive", False)):
            outs, dt = run_runtime(llm, batch, 0.0, args, speculative=spec)
            tps[mode] = sum(len(o.output_ids) for o in outs) / dt
        res[f"batch{b}"] = tps | {"speedup": tps["speculative"] / tps["autoregressive"]}
        log(f"batch-{b} speed: speculative {tps['speculative']:.1f} tok/s, autoregressive "
            f"{tps['autoregressive']:.1f} tok/s, speedup {res[f'batch{b}']['speedup']:.2f}x")
    return res


def table(rows: list[dict], blocks: list[int], temps: list[float]) -> str:
    lines = ["| draft | N | T | tau (95 % CI over prompts) | acceptance per position |",
             "|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lines.append(f"| {r['draft']} | {r['num_spec_tokens']} | {r['temperature']:g} | "
                     f"{r['tau']:.2f} ± {r.get('tau_ci95', 0.0):.2f} | {acc} |")
    by = {(r["draft"], r["num_spec_tokens"], r["temperature"]): r["tau"] for r in rows}
    lines.append("")
    for n in blocks:
        for t in temps:
            if ("DSpark", n, t) in by and ("DFlash", n, t) in by:
                g = by[("DSpark", n, t)] / by[("DFlash", n, t)] - 1
                a = by.get(("AR (1 layer)", n, t))
                extra = f", vs AR {by[('DSpark', n, t)] / a - 1:+.1%}" if a else ""
                lines.append(f"- N={n}, T={t:g}: DSpark tau vs DFlash {g:+.1%}{extra}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="output of `dspark-trt train`")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-spec-tokens", "--block-sizes", dest="num_spec_tokens", default="3,5,7",
                    help="N values swept (comma list; --block-sizes: the older name)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--speed-prompts", type=int, default=8, help="prompts for the batch-1 timing "
                                                                  "(0: skip)")
    ap.add_argument("--speed-batches", default="16",
                    help="further batch sizes timed as one batch of prompts (comma list; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None, help="result file suffix (default: device kind)")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.num_spec_tokens = [int(x) for x in args.num_spec_tokens.split(",")]
    args.speed_batches = [int(x) for x in args.speed_batches.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    run = Path(args.run_dir)
    for sub in ("target", "draft", "dflash", "ar_draft"):
        if not (run / sub / "config.json").exists():
            raise SystemExit(f"error: {run / sub} is not a checkpoint directory (no config.json)")

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    rows = []
    base = make_llm(run, "draft", max(args.num_spec_tokens), args)
    prompts, files_sha = load_prompts(base, args)
    train_summary = run / "train_summary.json"
    train_sha = None
    if (run / MANIFEST).exists():
        train_sha = files_sha                      # prompts come from the recorded eval split
    elif train_summary.exists():
        train_sha = json.loads(train_summary.read_text())["data"]["corpus"]["heldout_sha256"]
    if train_sha and train_sha != files_sha:
        log("note: this interpreter's held-out stdlib files differ from the training run's "
            f"(sha256 {files_sha[:12]} vs {train_sha[:12]}); prompts come from this one")
    # target-only reference (greedy): decides the lossless check of the greedy rows
    ref, ref_dt = run_runtime(base, prompts, 0.0, args, speculative=False)
    ref_ids = [o.output_ids for o in ref]
    log(f"{len(prompts)} prompts ({args.min_len}-{args.max_len} tokens), {args.max_new_tokens} new "
        f"tokens; target-only greedy: {ref_dt:.1f} s")
    ar = load_ar_draft(run / "ar_draft", DTYPES[args.dtype], args.device)
    for n in args.num_spec_tokens:
        for draft, name in (("draft", "DSpark"), ("dflash", "DFlash")):
            llm = base if (draft == "draft" and n == max(args.num_spec_tokens)) else make_llm(run, draft, n, args)
            for t in temps:
                outs, dt = run_runtime(llm, prompts, t, args)
                r = summarize([o.stats for o in outs], dt, sum(len(o.output_ids) for o in outs))
                if t == 0:
                    r["greedy_equals_target"] = sum(o.output_ids == g for o, g in zip(outs, ref_ids))
                rows.append({"draft": name, "temperature": t, **r})
                log(f"{name:6s} N={n} T={t:g}: tau {r['tau']:.2f} ({dt:.1f} s)")
        for t in temps:
            sync(args.device)
            t0 = time.perf_counter()
            res = ar_speculative_generate(base.target, ar, prompts, n, t, args.max_new_tokens,
                                          [args.seed + i for i in range(len(prompts))])
            sync(args.device)
            r = summarize([s for _, s in res], time.perf_counter() - t0, sum(len(i) for i, _ in res))
            if t == 0:
                r["greedy_equals_target"] = sum(i == g for (i, _), g in zip(res, ref_ids))
            rows.append({"draft": "AR (1 layer)", "temperature": t, **r})
            log(f"AR     N={n} T={t:g}: tau {r['tau']:.2f}")
    speed_res = speed(run, prompts, args, log) if args.speed_prompts > 0 else None
    md = table(rows, args.num_spec_tokens, temps)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {
        "git_sha": provenance.git_sha(), "device": args.device, "device_name": dev_name,
        "command": " ".join([Path(sys.executable).name] + sys.argv), "torch": torch.__version__,
        "python": platform.python_version(), "dtype": args.dtype, "run_dir": str(run),
        "train_heldout_sha256": train_sha, "eval_heldout_sha256": files_sha,
        "settings": {k: v for k, v in vars(args).items() if k not in ("run_dir", "results_dir")},
        "notes": {"tau": "mean tokens committed per round, bonus included",
                  "DSpark/DFlash": "project runtime (LLM.from_checkpoints + generate), eager",
                  "AR (1 layer)": "dspark_trt.train.ar_eval dense simulation, same verifier",
                  "greedy_equals_target": "prompts whose greedy speculative output equals the "
                                          "target-only greedy output (bf16 may flip near-ties)"},
        "rows": rows, "speed_batch1": speed_res, "table_markdown": md,
        "seconds": time.perf_counter() - t_start,
    }
    tag = args.tag or ("cuda" if args.device.startswith("cuda") else "cpu")
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"acceptance-{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"acceptance-{tag}.md").write_text(md + "\n")
    print(md)
    log(f"wrote {out / f'acceptance-{tag}.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
