"""``dspark-trt calibrate``: Sequential Temperature Scaling of the draft's confidence head.

Runs speculative decoding (fixed N, the given temperature) over held-out prompts, records each
round's confidence logits with the drafts it verified and accepted, splits the prompts in two
(even: fit, odd: report), fits the per-position temperatures on the first half
(``runtime/calibration.py``) and reports ECE and ROC-AUC of the prefix-survival product before and
after on the second, with the held-out prefix survival per position (``"survival"``: where a fresh
scheduler's AR fallback starts, ``SurvivalEstimate``). Writes ``confidence_calibration.json`` next
to the draft checkpoint (or to ``--out``), where ``LLM.from_checkpoints`` finds it; with
``--draft-vocab`` the set's own ``confidence_calibration.vocab-<size>-<hash>.json``, so neither
run finds the other's (``checkpoints.files.calibration_file``).

Prompts: ``--eval-set`` (a training run's ``distill/eval.pt``: its prompts), ``--prompts`` (a text
file, one prompt per line, or JSONL with "prompt" text or "prompt_ids"), else random token ids
(meaningful only for tests).
"""
from __future__ import annotations

import json
from pathlib import Path

from .common import add_model_args, load_llm


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate the draft's confidence head (Sequential "
                       "Temperature Scaling) on held-out prompts")
    add_model_args(p)
    p.add_argument("--eval-set", help="held-out DistillSet (a training run's distill/eval.pt)")
    p.add_argument("--prompts", help="prompt file: text lines, or JSONL with 'prompt' / 'prompt_ids'")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the calibration runs (the serving one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for confidence_calibration.json (with --draft-vocab: "
                   "confidence_calibration.vocab-<size>-<hash>.json; default: the draft checkpoint directory)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def load_prompts(args, llm) -> list[list[int]]:
    import numpy as np
    from ..runtime.sampling_params import RequestError
    n = args.num_prompts
    if args.eval_set:
        import torch
        d = torch.load(args.eval_set, weights_only=True)
        toks, plen = d["tokens"].to(torch.int64), d["prompt_len"]
        return [toks[i, :int(plen[i])].tolist() for i in range(min(n, toks.shape[0]))]
    if args.prompts:
        out = []
        for line in Path(args.prompts).read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                d = json.loads(line)
                out.append(d["prompt_ids"] if "prompt_ids" in d else llm.encode(d["prompt"]))
            else:
                out.append(llm.encode(line))
            if len(out) == n:
                break
        if not out:
            raise RequestError(f"--prompts {args.prompts}: no prompts")
        return out
    rng = np.random.default_rng(args.seed)
    V = llm.pair.target.vocab_size
    print("[dspark-trt] no --eval-set / --prompts: random token prompts (tests only)")
    return [rng.integers(0, V, size=int(rng.integers(4, 17))).tolist() for _ in range(n)]


def collect(llm, prompts: list[list[int]], max_new_tokens: int, temperature: float,
            seed: int) -> list[list]:
    """Per prompt: its rounds [(confidence logits [N], verified, accepted)]."""
    from ..runtime.sampling_params import RequestError, SamplingParams
    if not getattr(llm.networks, "has_confidence", False):
        raise RequestError("this draft has no confidence head (confidence_head.proj): nothing to calibrate")
    gen = llm.scheduler(record_confidence=True)
    room = llm.max_seq_len - max_new_tokens
    seqs = [gen.add_request(p[-room:], SamplingParams(temperature=temperature, seed=seed + i,
                                                      max_new_tokens=max_new_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while gen.has_work():
        gen.step()
    return [s.confidence or [] for s in seqs]


def calibrate(per_prompt: list[list], N: int) -> dict:
    """Fit on the even prompts, report on the odd ones (all prompts when there is one)."""
    from ..runtime import calibration as cal
    fit_rounds = [r for i, p in enumerate(per_prompt) if i % 2 == 0 for r in p]
    held_rounds = [r for i, p in enumerate(per_prompt) if i % 2 == 1 for r in p] or fit_rounds
    if not fit_rounds:
        raise ValueError("no speculative rounds recorded (prompts too long or max_new_tokens too small)")
    fit = cal.arrays(fit_rounds, N)
    held = cal.arrays(held_rounds, N)
    temps = cal.fit_sts(*fit)
    before, after = cal.metrics(*held, [1.0]), cal.metrics(*held, temps)
    return {"temperatures": temps, "survival": heldout_survival(after),
            "fit_rounds": len(fit_rounds), "heldout_rounds": len(held_rounds),
            "ece_before": before["ece"], "ece_after": after["ece"],
            "auc_before": before["auc"], "auc_after": after["auc"],
            "before": before, "after": after}


def heldout_survival(metrics: dict) -> list[float]:
    """The held-out rounds' prefix survival ``P(drafts 0..k accepted)`` per position (the labels'
    mean), up to the first position no round verified: a fresh scheduler's prior
    (``SurvivalEstimate``)."""
    out = []
    for p in metrics["per_position"]:
        if not p["count"]:
            break
        out.append(float(p["label_mean"]))
    return out


def run(args) -> int:
    from ..checkpoints.files import calibration_file
    from ..runtime.confidence import Calibration
    llm = load_llm(args)
    prompts = load_prompts(args, llm)
    per_prompt = collect(llm, prompts, args.max_new_tokens, args.temperature, args.seed)
    res = calibrate(per_prompt, llm.networks.num_spec_tokens)
    res["temperature"], res["prompts"] = args.temperature, len(prompts)
    out = args.out or args.draft_checkpoint or args.engine
    path = None
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Calibration(res["temperatures"], {k: v for k, v in res.items() if k != "temperatures"}
                           ).save(out, calibration_file(llm.draft))      # a draft vocabulary's own name
    if args.json:
        print(json.dumps({**res, "path": str(path) if path else None}))
        return 0
    print(f"temperatures: [{', '.join(f'{t:.3g}' for t in res['temperatures'])}] "
          f"({res['fit_rounds']} rounds fitted, {res['heldout_rounds']} held out)")
    surv = res["survival"]
    print(f"held-out prefix survival: [{', '.join(f'{v:.3f}' for v in surv)}] (tau {1 + sum(surv):.2f}: "
          f"a fresh scheduler's starting estimate)")
    print(f"held-out ECE of the prefix-survival product: {res['ece_before']:.4f} -> {res['ece_after']:.4f}; "
          f"ROC-AUC {res['auc_before']:.4f} -> {res['auc_after']:.4f}")
    print(f"written: {path}" if path else "not written (no --out and no checkpoint directory)")
    return 0
