"""How sensitive are random-weight drafts to rounding? Eager Qwen3-8B-shaped pair on the GPU, the
same round inputs as build_gpu.py's parity, three ways: Triton plugins + fused projections (what an
engine runs), Triton plugins unfused, and every dspark op replaced by its PyTorch reference. Prints
and writes (``$OUT/draft-sensitivity.json``) the draft-token agreement of each pair and whether
each first divergence is a near-tie (build_gpu.draft_flips).

    python benchmarks/draft_sensitivity.py [--markov-sampler topk|exact]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from build_gpu import draft_and_verify, draft_flips, round_inputs  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.builder.export import ReferenceOps  # noqa: E402
from dspark_trt.config import get_preset  # noqa: E402
from dspark_trt.models import build_models  # noqa: E402
from dspark_trt.models.fuse import fuse_projections_  # noqa: E402
from dspark_trt.runtime.networks import EagerNetworks  # noqa: E402


def networks(model: str, device: str, fused: bool, sampler: str, B: int, T: int):
    pair = get_preset(model)
    target, draft = build_models(pair, torch.bfloat16, torch.device(device), 0)
    if fused:
        fuse_projections_(target), fuse_projections_(draft)
    page = 64
    pages = -(-(T + 16) // page)
    nets = EagerNetworks(target, draft, B * pages, page, device, torch.bfloat16, sampler)
    nets.max_pages_per_seq = pages
    return nets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--markov-sampler", default="topk")
    ap.add_argument("--model", default="qwen3-8b-dspark-block7")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    B, T = 4, 64
    results = {}
    for name, fused, refs in (("fused_triton", True, False), ("unfused_triton", False, False),
                              ("unfused_reference", False, True)):
        nets = networks(a.model, a.device, fused, a.markov_sampler, B, T)
        with ReferenceOps() if refs else contextlib.nullcontext():
            out = draft_and_verify(nets, *round_inputs(nets, B, T, torch.device(a.device)))
        results[name] = {k: out[k] for k in ("drafts", "z", "prefill_logits")}
        del nets
        if a.device == "cuda":
            torch.cuda.empty_cache()
    report = {"git_sha": provenance.git_sha(), "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "model": a.model, "B": B, "T": T,
              "markov_sampler": a.markov_sampler, "pairs": {}}
    names = list(results)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            got, want = results[x], results[y]
            report["pairs"][f"{x}_vs_{y}"] = {
                "draft_tokens_equal_fraction": float((got["drafts"] == want["drafts"]).float().mean()),
                "prefill_max_abs_logit_diff": float((got["prefill_logits"].float() - want["prefill_logits"].float()).abs().max()),
                "draft_flips": draft_flips(got, want)}
    report["drafts"] = {k: v["drafts"].tolist() for k, v in results.items()}
    print(json.dumps(report, indent=1))
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    (out / "draft-sensitivity.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
