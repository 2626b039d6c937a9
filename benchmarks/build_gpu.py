"""GPU build benchmark: build AOTI engines on CUDA, record time + peak memory, check parity.

    CXX=/usr/bin/g++ python benchmarks/build_gpu.py [qwen3] [v4] [--git-sha SHA]

* qwen3: ``qwen3-8b-dspark-block7 --random-weights --dtype bf16 --backend aoti`` (weights drawn on
  the GPU), then compiled vs eager on the real shapes with the same seed: a prefill of B=4 x 64
  tokens, one draft step (draft_context + draft_block, greedy) and one verify step (target on
  N+1 tokens): max |logit diff| and token equality; plus the draft-step latency.
* v4: ``deepseek-v4-flash-dspark --random-weights --override num_hidden_layers=4`` when the
  preset exists: build time, peak memory and the draft-step latency (median of 20, CUDA events).

Each model writes ``build-<model>.json`` (git sha, GPU, command, stage times, peaks, parity) to
$OUT if set, else benchmarks/results/, as soon as it is done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dspark_trt.builder.build import BuildOptions, build_engine  # noqa: E402
from dspark_trt.config import PRESETS, get_preset  # noqa: E402
from dspark_trt.models import build_models  # noqa: E402
from dspark_trt.runtime.engine import EngineNetworks  # noqa: E402
from dspark_trt.runtime.networks import EagerNetworks  # noqa: E402

ENGINES = Path(os.environ.get("ENGINE_ROOT", "/tmp/dspark-engines"))
RESULTS = Path(os.environ.get("OUT") or Path(__file__).parent / "results")


def git_sha(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown (no .git; pass --git-sha)"


def save(name: str, record: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"build-{name}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"[bench] wrote {path}", flush=True)


def build(opts: BuildOptions) -> dict:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = build_engine(opts, report=lambda s: print(s, flush=True))
    return {"command": opts.command_line(), "wall_seconds": round(time.perf_counter() - t0, 1),
            "stage_seconds": m["build_stats"]["stage_seconds"], "peak_memory": m["build_stats"]["peak_memory"],
            "engine_bytes": sum(f["bytes"] for f in m["files"].values())}


def time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() (eager launches, no CUDA graph)."""
    out = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out[3:])[reps // 2]


def round_inputs(nets, B: int, T: int, device):
    """Prefill B rows of T random tokens; block table of consecutive pages per row."""
    g = torch.Generator(device="cpu").manual_seed(1)
    pages = nets.max_pages_per_seq
    table = torch.arange(B * pages, device=device).view(B, pages)
    tokens = torch.randint(0, nets.vocab_size, (B, T), generator=g).to(device)
    pos = torch.arange(T, device=device).repeat(B, 1)
    return tokens, pos, table


def draft_and_verify(nets, tokens, pos, table):
    """prefill -> draft_context -> draft_block (greedy) -> verify target on [anchor, drafts]."""
    B, T = tokens.shape
    logits, taps = nets.target(tokens, pos, table)
    anchor = logits[:, -1].argmax(-1)
    nets.draft_context(taps, pos, table)
    start = torch.full((B,), T, device=tokens.device)
    temp, seed = torch.zeros(B, device=tokens.device), torch.arange(B, device=tokens.device)
    drafts, z = nets.draft_block(anchor, start, table, temp, seed)
    vpos = start[:, None] + torch.arange(drafts.shape[1] + 1, device=tokens.device)
    vlogits, _ = nets.target(torch.cat([anchor[:, None], drafts], 1), vpos, table)
    return {"prefill_logits": logits, "drafts": drafts, "z": z, "verify_logits": vlogits,
            "draft_step": lambda: nets.draft_block(anchor, start, table, temp, seed)}


def draft_flips(got: dict, want: dict) -> dict:
    """Where the drafts of a row first differ, why? Both sides had the same earlier tokens there, so
    their z differ by rounding only, except that the top-k sampler's candidate sets (per-chunk top-k
    of the base logits) can differ at a rounding-level near-tie. A flip is a *candidate-set* flip
    when either winner is -inf on the other side; else it is *clear* when the eager top-2 margin
    exceeds twice the max |z diff| over the entries finite on both sides (else a near-tie)."""
    diff_rows = (got["drafts"] != want["drafts"]).any(1).nonzero().flatten().tolist()
    clear, cand, margins, diffs = 0, 0, [], []
    for b in diff_rows:
        k = int((got["drafts"][b] != want["drafts"][b]).nonzero()[0])
        a, w = got["z"][b, k].float(), want["z"][b, k].float()
        ta, tw = int(got["drafts"][b, k]), int(want["drafts"][b, k])
        if not (torch.isfinite(w[ta]) and torch.isfinite(a[tw])):
            cand += 1
            continue
        both = torch.isfinite(a) & torch.isfinite(w)
        d = float((a[both] - w[both]).abs().max())
        top2 = w.topk(2).values
        m = float(top2[0] - top2[1])
        margins.append(m), diffs.append(d)
        clear += int(m > 2 * d)
    return {"rows_differing": len(diff_rows), "candidate_set_flips": cand, "clear_flips": clear,
            "first_flip_eager_top2_margin": margins, "first_flip_max_abs_z_diff": diffs}


def parity(engine_dir: Path, opts: BuildOptions, B: int = 4, T: int = 64) -> dict:
    device = torch.device("cuda")
    nets = EngineNetworks(engine_dir, device=device, max_batch_size=B, max_seq_len=opts.max_seq_len)
    dtype = nets.dtype
    from dspark_trt.builder.build import apply_overrides
    o = opts.resolved()           # the reference: same seed -> same weights, unfused eager modules
    target, draft = build_models(apply_overrides(get_preset(o.model), o.overrides), dtype, device,
                                 o.num_spec_tokens, o.seed)
    draft.markov_sampler = o.markov_sampler
    eager = EagerNetworks(target, draft, nets.num_pages, nets.page_size, device, dtype)
    eager.max_pages_per_seq, eager.vocab_size = nets.max_pages_per_seq, nets.vocab_size
    inputs = round_inputs(nets, B, T, device)
    got, want = draft_and_verify(nets, *inputs), draft_and_verify(eager, *inputs)
    def diff(k: str) -> float:
        """Max |difference| over finite entries; inf entries (the top-k proposal's -inf outside
        its candidates) must sit at the same places, else inf."""
        a, b = got[k].float(), want[k].float()
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return float("inf")
        fin = torch.isfinite(b)
        return float((a[fin] - b[fin]).abs().max())
    argmax_eq = lambda k: float((got[k].argmax(-1) == want[k].argmax(-1)).float().mean())  # noqa: E731

    def clear_flips(k: str) -> int:
        """argmax differences where the eager top-2 margin exceeds twice the max logit diff (a
        flip there is a real error; below it, a near-tie resolved differently by bf16 rounding)."""
        top2 = want[k].float().topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * diff(k)
        return int(((got[k].argmax(-1) != want[k].argmax(-1)) & clear).sum())
    out = {"batch": B, "prompt_tokens": T, "num_spec_tokens": nets.num_spec_tokens,
           "prefill_max_abs_logit_diff": diff("prefill_logits"),
           "prefill_argmax_equal_fraction": argmax_eq("prefill_logits"),
           "draft_tokens_equal_fraction": float((got["drafts"] == want["drafts"]).float().mean()),
           "draft_max_abs_logit_diff": diff("z"),
           "verify_max_abs_logit_diff": diff("verify_logits"),
           "verify_argmax_equal_fraction": argmax_eq("verify_logits"),
           "argmax_flips_beyond_rounding": clear_flips("prefill_logits") + clear_flips("verify_logits"),
           "draft_flips": draft_flips(got, want),
           "reference_fallback_networks": nets.manifest.get("reference_fallback", []),
           "draft_step_ms_engine": time_ms(got["draft_step"]),
           "draft_step_ms_eager": time_ms(want["draft_step"])}
    print(json.dumps(out, indent=2), flush=True)
    return out


def run(name: str, opts: BuildOptions, sha: str, check_parity: bool, keep: bool = False) -> None:
    record = {"model": name, "git_sha": sha, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "argv": sys.argv}
    record["build"] = build(opts)
    save(name, record)
    if check_parity:
        record["parity"] = parity(Path(opts.output), opts)
    else:
        nets = EngineNetworks(opts.output, device="cuda", max_batch_size=4)
        step = draft_and_verify(nets, *round_inputs(nets, 4, 64, torch.device("cuda")))["draft_step"]
        record["draft_step_ms_engine_b4"] = time_ms(step)
    save(name, record)
    if keep:
        print(f"[bench] engine kept at {opts.output}", flush=True)
    else:
        shutil.rmtree(opts.output, ignore_errors=True)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["qwen3", "v4"], choices=["qwen3", "v4"])
    ap.add_argument("--git-sha")
    ap.add_argument("--keep", action="store_true", help="keep the engines (for a following bench)")
    ap.add_argument("--markov-sampler", choices=["exact", "topk"], default="exact")
    a = ap.parse_args()
    sha = git_sha(a.git_sha)
    if "qwen3" in a.which:
        m = "qwen3-8b-dspark-block7"
        run(m, BuildOptions(model=m, output=str(ENGINES / m), random_weights=True, dtype="bf16", max_batch_size=64,
                            check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1",
                            backend="aoti", device="cuda", markov_sampler=a.markov_sampler),
            sha, check_parity=True, keep=a.keep)
    if "v4" in a.which:
        m = "deepseek-v4-flash-dspark"
        if m not in PRESETS:
            print(f"[bench] preset '{m}' is not defined on this branch: V4 build skipped", flush=True)
            return
        run(m, BuildOptions(model=m, output=str(ENGINES / m), random_weights=True, dtype="bf16", max_batch_size=64,
                            check_toolchain=os.environ.get("DSPARK_CHECK_TOOLCHAIN", "1") == "1",
                            backend="aoti", device="cuda", overrides=["num_hidden_layers=4"],
                            markov_sampler=a.markov_sampler),
            sha, check_parity=False, keep=a.keep)


if __name__ == "__main__":
    main()
