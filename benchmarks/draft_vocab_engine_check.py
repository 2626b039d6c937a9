"""A draft vocabulary compiled into an engine, checked end to end (a GPU smoke of ``build
--draft-vocab``): builds the tiny preset with a draft vocabulary (every 4th token id), then compares
greedy generation of the engine, of the eager modules with the same set and of the eager modules
without it (all three must give the target's tokens: speculative decoding is lossless), the
manifest's record of the set, and the bench roofline of the engine against the eager one's.

In fp32 (the default) every path gives the target's greedy tokens exactly. In bf16 they may part at
a near tie: on an H100 (session 51) the engine left the modules' output at token 18 of one prompt
and the speculative modules left the target-only run at token 17 of another, with or without the
set (the verify's 8-row GEMMs and the one-token steps round differently).

    python benchmarks/draft_vocab_engine_check.py [--out-dir DIR] [--device cuda] [--dtype fp32]

Writes <out-dir>/draft-vocab-engine-<device>-<sha>.json; exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dspark_trt import LLM, SamplingParams, provenance  # noqa: E402
from dspark_trt.cli import main as cli  # noqa: E402
from dspark_trt.commands.bench import roofline  # noqa: E402
from dspark_trt.commands.draft_vocab import write_draft_vocab  # noqa: E402
from dspark_trt.config import get_preset  # noqa: E402

PRESET = "qwen3-tiny-dspark"


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [o.output_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="fp32", help="fp32 (default): greedy outputs of different paths "
                    "(verify of 8 tokens, one-token steps) compare exactly; in bf16 near ties may differ")
    args = ap.parse_args()
    V = get_preset(PRESET).target.vocab_size
    prompts = [[5, 9, 2, 7, 11], [1, 3, 3, 8], [40, 41, 42, 43, 44, 45]]
    kw = dict(device=args.device, max_batch_size=4, max_seq_len=64, page_size=8)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.json"
        write_draft_vocab(vocab, torch.arange(0, V, 4), V, {"check": "every 4th id"})
        engine = Path(tmp) / "engine"
        t0 = time.perf_counter()
        rc = cli(["build", "--model", PRESET, "--random-weights", "--device", args.device, "--max-batch-size", "4",
                  "--max-seq-len", "64", "--page-size", "8", "--dtype", args.dtype, "--draft-vocab", str(vocab), "--output", str(engine)])
        build_s = time.perf_counter() - t0
        if rc:
            print(f"[vocab-engine] build failed (exit {rc})")
            return 1
        manifest = json.loads((engine / "manifest.json").read_text())
        eng = LLM.from_engine(engine, device=args.device)
        eager_set = LLM.from_preset(PRESET, dtype=eng.networks.dtype, draft_vocab=str(vocab), **kw)
        eager_full = LLM.from_preset(PRESET, dtype=eng.networks.dtype, **kw)
        outs = {name: greedy(llm, prompts, args.new_tokens)
                for name, llm in (("engine", eng), ("eager_set", eager_set), ("eager_full", eager_full))}
        target_only = [o.output_ids for o in eager_full.generate(
            prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True), speculative=False)]
        tbps = 1.0
        roof_engine, roof_eager = roofline(eng, 1, 16, tbps), roofline(eager_set, 1, 16, tbps)
    checks = {
        "greedy_equal_to_target": all(o == target_only for o in outs.values()),
        "manifest_records_the_set": (manifest.get("draft_vocab") or {}).get("size") == V // 4,
        "engine_roofline_counts_the_set": roof_engine.get("draft_weight_bytes") == roof_eager.get("draft_weight_bytes"),
    }
    res = {"git_sha": provenance.git_sha(), "preset": PRESET, "device": args.device, "draft_vocab_size": V // 4, "vocab_size": V,
           "build_seconds": round(build_s, 1), "manifest_draft_vocab": manifest.get("draft_vocab"),
           "outputs": outs, "target_only": target_only, "roofline_engine": roof_engine, "roofline_eager": roof_eager,
           "checks": checks, "command": " ".join(sys.argv)}
    name = torch.cuda.get_device_name().replace(" ", "-") if args.device == "cuda" else "cpu"
    out = Path(args.out_dir) / f"draft-vocab-engine-{name}-{res.get('git_sha', 'unknown')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for k, v in checks.items():
        print(f"[vocab-engine] {k}: {'ok' if v else 'FAILED'}")
    print(f"[vocab-engine] build {build_s:.1f} s; wrote {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
