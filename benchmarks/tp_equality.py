"""TP=2 equals TP=1 on real shapes (random weights): run under torchrun with 2 GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tp_equality.py \
        --model qwen3-8b-dspark-block7 --out $OUT/tp_equality.json

Both ranks build the preset's random weights from the same seed and shard them (TP=2); rank 0
then builds the unsharded model (TP=1) on its GPU. Compared: the target's logits on a prompt
(max |diff| against the logits' scale), and greedy outputs token for token, speculative and
autoregressive. float32 by default: TP only reorders the sums (row-parallel partials + all_reduce),
so logits agree to ~1e-6 relative and greedy tokens should match unless two logits tie that
closely (the top-2 margin at the first divergence is recorded if they do not).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.runtime import LLM, SamplingParams  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def run(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    nets = llm.networks
    tokens = torch.tensor(prompts[0], device=nets.device)[None]
    pos = torch.arange(tokens.shape[1], device=nets.device)[None]
    pages = -(-tokens.shape[1] // nets.page_size)
    logits, _ = nets.target(tokens, pos, torch.arange(pages, device=nets.device)[None])
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    spec = [o.output_ids for o in llm.generate(prompts, sp)]
    t1 = time.perf_counter()
    ar = [o.output_ids for o in llm.generate(prompts, sp, speculative=False)]
    return {"logits": logits[0].float().cpu(), "spec": spec, "ar": ar,
            "seconds": {"spec": t1 - t0, "ar": time.perf_counter() - t1}}


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b-dspark-block7")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    kw = dict(dtype=DTYPES[a.dtype], max_batch_size=a.batch, max_seq_len=a.prompt_len + a.new_tokens + 8,
              page_size=64, cuda_graphs=False)
    t0 = time.perf_counter()
    tp2 = LLM.from_preset(a.model, tp_size=2, **kw)
    rank, V = dist.get_rank(), tp2.pair.target.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V, (a.batch, a.prompt_len), generator=g).tolist()
    r2 = run(tp2, prompts, a.new_tokens)
    t_tp2 = time.perf_counter() - t0
    cuda = tp2.device.type == "cuda"
    del tp2
    if cuda:
        torch.cuda.empty_cache()
    if rank == 0:
        t0 = time.perf_counter()
        tp1 = LLM.from_preset(a.model, tp_size=1, device="cuda:0" if cuda else "cpu", **kw)
        r1 = run(tp1, prompts, a.new_tokens)
        diff = (r1["logits"] - r2["logits"]).abs()
        top2 = r1["logits"].topk(2, -1).values
        report = {
            "git_sha": provenance.git_sha(), "gpu": torch.cuda.get_device_name() if cuda else "cpu", "model": a.model,
            "dtype": a.dtype, "world": dist.get_world_size(), "batch": a.batch,
            "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
            "logits_max_abs_diff": diff.max().item(), "logits_std": r1["logits"].std().item(),
            "logits_max_rel_diff": (diff.max() / r1["logits"].abs().max()).item(),
            "argmax_equal_all_prompt_positions": bool((r1["logits"].argmax(-1) == r2["logits"].argmax(-1)).all()),
            "min_top2_margin_prompt": (top2[:, 0] - top2[:, 1]).min().item(),
            "spec_tokens_equal": r1["spec"] == r2["spec"], "ar_tokens_equal": r1["ar"] == r2["ar"],
            "spec_first_divergence": first_divergence(r1["spec"], r2["spec"]),
            "ar_first_divergence": first_divergence(r1["ar"], r2["ar"]),
            "tp1_spec_equals_tp1_ar": r1["spec"] == r1["ar"],
            "seconds": {"tp2_total": t_tp2, "tp1_total": time.perf_counter() - t0,
                        "tp2_generate": r2["seconds"], "tp1_generate": r1["seconds"]},
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in report.items() if k != "seconds"}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
