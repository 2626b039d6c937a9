"""Acceptance of an fp8 draft (``--draft-quantization fp8``: the draft's attention / MLP projections
in fp8 e4m3 with 128x128 block scales, weight-only) against the draft as trained, on the built-in
default pair with the held-out prompts of ``dspark-trt bench --prompts heldout``.

Per draft format and temperature: tau with its 95 % interval over prompts, acceptance per position,
and at temperature 0 whether every output equals the unquantised draft's (it must: the target
verifies, both are lossless); the draft projections' bytes in each format.

    python benchmarks/draft_quant_acceptance.py [--num-prompts 32] [--temperatures 0,1]

Writes benchmarks/results/draft-quant-acceptance-<device>-<sha>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.draft_vocab_acceptance import parse_run_args, run, save  # noqa: E402
from dspark_trt import LLM, provenance  # noqa: E402
from dspark_trt.commands.bench import make_prompts  # noqa: E402
from dspark_trt.config.source import default_pair_dirs  # noqa: E402
from dspark_trt.models.fp8_linear import FP8_PROJECTIONS  # noqa: E402


def projection_bytes(draft) -> int:
    """Bytes of the draft's attention / MLP projection weights (and their fp8 block scales)."""
    names = FP8_PROJECTIONS + ("qkv_proj", "gate_up_proj")
    return sum(t.numel() * t.element_size() for n, m in draft.named_modules() if n.rsplit(".", 1)[-1] in names
               for t in (m.weight, getattr(m, "weight_scale_inv", None)) if t is not None)


def main() -> int:
    a, kw = parse_run_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    dirs = default_pair_dirs()
    report = {"git_sha": provenance.git_sha(), "command": " ".join(sys.argv), "device": a.device,
              "model": "built-in default pair", "shapes": {"num_prompts": a.num_prompts, "prompt_len": a.prompt_len,
                                                          "gen_len": a.gen_len}, "drafts": {}}
    reference = prompts = None
    for mode in ("none", "fp8"):
        llm = LLM.from_checkpoints(*dirs, draft_quantization=mode, **kw)
        prompts = prompts or make_prompts(llm, "heldout", a.num_prompts, a.prompt_len, a.seed).tolist()   # once
        row = {"projection_bytes": projection_bytes(llm.draft), "dtype": str(llm.dtype)}
        for t in (float(v) for v in a.temperatures.split(",")):
            stats, outs, dt = run(llm, prompts, t, a.gen_len)
            stats["seconds"] = dt
            if t == 0.0:
                reference = reference or outs
                stats["greedy_equal_to_unquantised"] = outs == reference
            row[f"T={t:g}"] = stats
            print(f"[draft-quant] {mode:4s} T={t:g}: tau {stats['tau']:.3f} ± {stats['tau_ci95']:.3f}"
                  + (f", greedy equal {stats['greedy_equal_to_unquantised']}" if t == 0.0 else ""), flush=True)
        report["drafts"][mode] = row
    print(f"[draft-quant] wrote {save(report, a.out_dir, 'draft-quant-acceptance', a.device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
