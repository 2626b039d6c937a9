"""``dspark-trt generate``: prompt in, text and acceptance statistics out."""
from __future__ import annotations

import json
import time

from .common import add_model_args, load_llm


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(p)
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (needs a tokenizer)")
    p.add_argument("--prompt-ids", help="comma-separated prompt token ids (instead of --prompt)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="replay the decode steps from CUDA graphs (auto: on for CUDA)")
    p.add_argument("--no-warmup", action="store_true",
                   help="GPU: time the first call too (Triton JIT compilation and graph capture)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..runtime.sampling_params import SamplingParams
    llm = load_llm(args)
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif llm.tokenizer is None:
        prompt = [1, 2, 3, 4]
        print("[dspark-trt] model has no tokenizer: using prompt ids [1, 2, 3, 4]")
    else:
        prompt = args.prompt
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    speculative = not args.no_speculative
    warmup = None
    if llm.device.type == "cuda" and not args.no_warmup:
        warmup = _timed(llm, prompt, sp, speculative)["seconds"]
        print(f"[dspark-trt] warm-up {warmup:.2f} s (Triton JIT compilation and CUDA-graph capture; "
              f"CUDA graphs {'off: ' + llm.graphs_skipped if llm.graphs_skipped else 'on'})")
    run = _timed(llm, prompt, sp, speculative)
    out, dt = run["output"], run["seconds"]
    stats = out.stats.to_dict()
    if args.json:
        print(json.dumps({"output_ids": out.output_ids, "text": out.text, "stats": stats,
                          "seconds": dt, "prefill_seconds": run["prefill_seconds"],
                          "decode_seconds": run["decode_seconds"], "warmup_seconds": warmup,
                          "finish_reason": out.finish_reason}))
        return 0
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
    return 0


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
