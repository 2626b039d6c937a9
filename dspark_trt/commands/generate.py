"""``dspark-trt generate``: prompt in, text and acceptance statistics out."""
from __future__ import annotations

import dataclasses
import json
import sys
import time

from .common import add_model_args, load_llm
from .request_args import check_generate_args

DEFAULT_PROMPT, DEFAULT_IDS = "def fibonacci(n):", [1, 2, 3, 4]
WARMUP_TOKENS = 16          # a few rounds: the prefill, the decode steps and their graphs, compiled once


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(p)
    p.add_argument("--prompt", default=None, help=f"prompt text (needs a tokenizer; default: "
                   f"{DEFAULT_PROMPT!r}, or ids {DEFAULT_IDS} for a model without one)")
    p.add_argument("--prompt-ids", help="comma-separated prompt token ids (instead of --prompt)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top probability (0: off)")
    for name, off in (("presence", 0.0), ("frequency", 0.0), ("repetition", 1.0)):
        p.add_argument(f"--{name}-penalty", type=float, default=off, help=f"vLLM's (off: {off:g})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--verify-mode", choices=["fixed", "threshold", "scheduled"], default="fixed",
                   help="drafts verified per round: fixed (all N), threshold (before the first "
                        "confidence below --confidence-threshold), scheduled (load-aware, paper "
                        "Algorithm 1); the last two need a draft with a confidence head")
    p.add_argument("--confidence-threshold", type=float, default=0.5)
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="replay the decode steps from CUDA graphs (auto: on for CUDA)")
    p.add_argument("--no-warmup", action="store_true",
                   help="GPU: time the first call too (Triton JIT compilation and graph capture)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..runtime.sampling_params import SamplingParams
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed,
                        verify_mode=args.verify_mode, confidence_threshold=args.confidence_threshold,
                        top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        repetition_penalty=args.repetition_penalty)
    prompt = check_generate_args(args, sp)          # before anything loads
    llm = load_llm(args)                            # on a CPU it says which dtype "auto" picked
    if prompt is None and llm.tokenizer is None:
        prompt = DEFAULT_IDS
        print(f"[dspark-trt] model has no tokenizer: using prompt ids {DEFAULT_IDS}", file=sys.stderr)
    elif prompt is None:
        prompt = DEFAULT_PROMPT
    speculative = not args.no_speculative
    warmup = None
    if llm.device.type == "cuda" and not args.no_warmup:
        short = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, WARMUP_TOKENS))
        warmup = _timed(llm, prompt, short, speculative)["seconds"]      # every kernel and graph once
        print(f"[dspark-trt] warm-up {warmup:.2f} s (Triton JIT compilation and CUDA-graph capture; "
              f"CUDA graphs {'off: ' + llm.graphs_skipped if llm.graphs_skipped else 'on'})",
              file=sys.stderr)
    run = _timed(llm, prompt, sp, speculative)
    out, dt = run["output"], run["seconds"]
    stats = out.stats.to_dict()
    if args.json:
        print(json.dumps({"output_ids": out.output_ids, "text": out.text, "stats": stats,
                          "seconds": dt, "prefill_seconds": run["prefill_seconds"],
                          "decode_seconds": run["decode_seconds"], "warmup_seconds": warmup,
                          "finish_reason": out.finish_reason, **({"error": out.error} if out.error else {})}))
        return _report_error(out)
    if isinstance(prompt, str):
        print(prompt + (out.text or ""))
    else:
        print(f"output ids: {out.output_ids}")
        if out.text is not None:
            print(out.text)
    decoded = max(len(out.output_ids) - 1, 0)        # the first token comes with the prefill
    print(f"--- {len(out.output_ids)} tokens in {dt:.2f} s: prefill {run['prefill_seconds'] * 1e3:.1f} ms, "
          f"decode {run['decode_seconds']:.2f} s ({decoded / max(run['decode_seconds'], 1e-9):.1f} tok/s); "
          f"finish: {out.finish_reason}")
    if stats["rounds"]:
        acc = ", ".join(f"{a:.2f}" for a in stats["acceptance_per_position"])
        print(f"--- speculative: {stats['rounds']} rounds, mean accepted length tau = {stats['tau']:.2f} "
              f"(bonus included), acceptance per position: [{acc}]")
    return _report_error(out)


def _report_error(out) -> int:
    """A request that ended with finish_reason "error": its message on stderr, exit code 1."""
    if out.finish_reason != "error":
        return 0
    print(f"error: {out.error}", file=sys.stderr)
    return 1


def _timed(llm, prompt, sp, speculative: bool) -> dict:
    """One generate call: output, wall seconds, and prefill (to the first token) / decode split.
    The first chunk is handed over after the prefill step has read its token back to the host."""
    first: list[float] = []

    def on_chunk(_chunk) -> None:
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    out = llm.generate(prompt, sp, speculative=speculative, on_chunk=on_chunk)[0]
    dt = time.perf_counter() - t0
    prefill = (first[0] - t0) if first else dt
    return {"output": out, "seconds": dt, "prefill_seconds": prefill, "decode_seconds": dt - prefill}
