"""Acceptance of the draft over a frequency-ranked sub-vocabulary (``--draft-vocab``,
``models/draft_vocab.py``) against the full vocabulary, on the built-in default pair (V = 8192):
the sets are the most frequent tokens of its training corpus (the stdlib modules it was trained on,
held-out modules excluded), the prompts the held-out modules (``dspark-trt bench --prompts heldout``).

Per set size and temperature: tau (mean tokens per round, bonus included) with its 95 % interval
over prompts, acceptance per position, the share of the generated tokens inside the set, and at
temperature 0 whether every output equals the full vocabulary's (it must: both are lossless).

    python benchmarks/draft_vocab_acceptance.py [--sizes 512,1024,2048,4096] [--num-prompts 32]

Writes benchmarks/results/draft-vocab-acceptance-<device>-<sha>.json.
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
from dspark_trt.commands.bench import make_prompts  # noqa: E402
from dspark_trt.commands.draft_vocab import count_tokens, write_draft_vocab  # noqa: E402
from dspark_trt.config.source import default_pair_dirs  # noqa: E402
from dspark_trt.models.draft_vocab import rank_tokens  # noqa: E402
from dspark_trt.train.corpus import HELDOUT, read_stdlib  # noqa: E402


def run(llm: LLM, prompts, temperature: float, gen_len: int) -> tuple[dict, list[list[int]], float]:
    """Speculative generation of every prompt at once -> (stats, outputs, seconds)."""
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=gen_len, ignore_eos=True)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    merged = outs[0].stats
    for o in outs[1:]:
        merged = merged.merge(o.stats)
    taus = [o.stats.tau for o in outs]
    mean = sum(taus) / len(taus)
    var = sum((t - mean) ** 2 for t in taus) / max(1, len(taus) - 1)
    d = merged.to_dict()
    d["tau_ci95"] = 1.96 * (var / len(taus)) ** 0.5
    return d, [o.output_ids for o in outs], dt


def parse_run_args(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, dict]:
    """The held-out runs' options added to ``ap`` and parsed -> (args, ``LLM`` keywords for them)."""
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    return a, dict(device=a.device, max_batch_size=a.num_prompts, max_seq_len=a.prompt_len + a.gen_len + 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    a, kw = parse_run_args(ap)
    target_dir, draft_dir = default_pair_dirs()
    full = LLM.from_checkpoints(target_dir, draft_dir, **kw)
    V = full.pair.target.vocab_size
    train, _, manifest = read_stdlib(heldout=HELDOUT)
    counts = count_tokens(full.tokenizer, [f.text for f in train], V)
    prompts = make_prompts(full, "heldout", a.num_prompts, a.prompt_len, a.seed).tolist()
    temps = [float(t) for t in a.temperatures.split(",")]
    sizes = [int(s) for s in a.sizes.split(",")] + [V]
    report = {"git_sha": provenance.git_sha(), "command": " ".join(sys.argv), "device": a.device,
              "model": "built-in default pair", "vocab_size": V,
              "corpus": {"train_files": len(train), "tokens": int(counts.sum()),
                         "python": manifest.python_version},
              "shapes": {"num_prompts": a.num_prompts, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                         "num_spec_tokens": full.networks.num_spec_tokens},
              "sizes": {}}
    reference: dict[float, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sorted(sizes, reverse=True):                  # the full vocabulary first
            ids = rank_tokens(counts, size, tuple(full.pair.target.eos_token_id))
            if size == V:
                llm = full
            else:
                path = Path(tmp) / f"v{size}.json"
                write_draft_vocab(path, ids, V, {"corpus": "stdlib train split"})
                llm = LLM.from_checkpoints(target_dir, draft_dir, draft_vocab=str(path), **kw)
            inside = torch.zeros(V, dtype=torch.bool)
            inside[ids] = True
            row = {"corpus_coverage": float(counts[ids].sum() / counts.sum())}
            for t in temps:
                stats, outs, dt = run(llm, prompts, t, a.gen_len)
                gen = torch.tensor([x for o in outs for x in o])
                stats.update(seconds=dt, generated_in_set=float(inside[gen].float().mean()))
                if t == 0.0:
                    reference.setdefault(t, outs)
                    stats["greedy_equal_to_full"] = outs == reference[t]
                row[f"T={t:g}"] = stats
                print(f"[draft-vocab] size {size:5d} ({row['corpus_coverage']:.1%} of the corpus) T={t:g}: "
                      f"tau {stats['tau']:.3f} ± {stats['tau_ci95']:.3f}, in set {stats['generated_in_set']:.1%}"
                      + (f", greedy equal {stats['greedy_equal_to_full']}" if t == 0.0 else ""), flush=True)
            report["sizes"][str(size)] = row
    print(f"[draft-vocab] wrote {save(report, a.out_dir, 'draft-vocab-acceptance', a.device)}")
    return 0


def save(report: dict, out_dir: str, name: str, device: str) -> Path:
    """``report`` as ``<out_dir>/<name>-<device>-<git sha>.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{device}-{report['git_sha']}.json"
    path.write_text(json.dumps(report, indent=1))
    return path


if __name__ == "__main__":
    sys.exit(main())
