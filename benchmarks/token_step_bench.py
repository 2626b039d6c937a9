"""The one-token kernel chain (``runtime/token_step.py``, issue #21) against the module step, in
CUDA graphs, at Qwen3-8B dimensions (bf16, random weights, fused q/k/v and gate/up).

Per context length L (the token at position L; the cache holds random K/V below it):
- ``module``: ``Qwen3ForCausalLM.forward`` of one token, eager modules captured in a CUDA graph
  (what ``LLM``'s eager CUDA-graph AR step replays: cuBLAS GEMVs and torch elementwise kernels);
- ``chain``: ``TokenStep`` without PDL; ``chain_pdl``: with programmatic dependent launch.
Each: median ms of graph replays, the fraction of the HBM roofline (weights of every layer and the
head, plus the K/V rows read, at 4.8 TB/s), and the logits' agreement with the module step (the
largest difference over the logits' scale, argmax equal). Writes
``token-step-<gpu>-<sha>.json`` to ``--out``.

    python benchmarks/token_step_bench.py [--layers 36] [--contexts 128,1024,8192,32768]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dspark_trt import provenance  # noqa: E402
from dspark_trt.config import Qwen3Config  # noqa: E402
from dspark_trt.models.fuse import fuse_projections_  # noqa: E402
from dspark_trt.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from dspark_trt.runtime.token_step import TokenStep  # noqa: E402

HBM = 4.8e12
PAGE = 16


def graph_ms(fn, iters: int) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (warmed up eagerly first)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[iters // 2]


def build(layers: int, vocab: int, max_context: int):
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg, tap_layer_ids=(1, layers // 2, layers - 2)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    fuse_projections_(model)
    pages = -(-(max_context + 1) // PAGE)
    cache = model.make_cache(pages, PAGE, torch.bfloat16, "cuda")
    for c in cache["k"] + cache["v"]:
        c.normal_()
    return model, cache, torch.arange(pages, device="cuda")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--contexts", default="128,1024,8192,32768")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("[token-step] needs a CUDA GPU")
    t0 = time.perf_counter()
    contexts = [int(c) for c in args.contexts.split(",")]
    model, cache, pages = build(args.layers, args.vocab, max(contexts))
    token = torch.tensor([11], device="cuda")
    steps = {"chain": TokenStep(model), "chain_pdl": TokenStep(model, pdl=True)}
    chain = steps["chain"]                                           # the bytes a step must read
    weight_bytes = sum(t.numel() * t.element_size() for w in chain.layers for t in vars(w).values()) + sum(
        t.numel() * t.element_size() for t in (chain.lm_head, chain.final_norm))
    kv_row = 2 * 8 * 128 * 2                                         # K and V of one position, one layer
    rows = []
    for L in contexts:
        pos = torch.tensor([L], device="cuda")
        out = {}
        with torch.inference_mode():
            fns = {"module": lambda: model(token[None], pos[None], pages[None], cache)[0][0, 0]}
            fns.update({k: (lambda s=s: s(token, pos, cache, pages)[0]) for k, s in steps.items()})
            ref = fns["module"]().float()
            for name, fn in fns.items():
                logits = fn().float()
                ms = graph_ms(fn, args.iters)
                bytes_ = weight_bytes + args.layers * (L + 1) * kv_row
                out[name] = {"ms": ms, "hbm_fraction": bytes_ / HBM / (ms * 1e-3),
                             "logit_err": float((logits - ref).abs().max() / ref.abs().max()),
                             "argmax_equal": int(logits.argmax()) == int(ref.argmax())}
        out["roofline_ms"] = (weight_bytes + args.layers * (L + 1) * kv_row) / HBM * 1e3
        rows.append({"context": L, **out})
        print(f"[token-step] L={L:6d} roofline {out['roofline_ms']:.3f} ms | " + " | ".join(
            f"{k} {v['ms']:.3f} ms ({100 * v['hbm_fraction']:.1f} %, err {v['logit_err']:.3g}, "
            f"argmax {'=' if v['argmax_equal'] else '!='})" for k, v in out.items() if isinstance(v, dict)),
            flush=True)
    sha = provenance.git_sha()
    gpu = torch.cuda.get_device_name()
    report = {"git_sha": sha, "gpu": gpu, "command": "python benchmarks/token_step_bench.py " + " ".join(sys.argv[1:]),
              "shapes": {"layers": args.layers, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                         "intermediate": 12288, "vocab": args.vocab, "dtype": "bf16", "batch": 1, "page": PAGE},
              "weight_bytes": weight_bytes, "hbm_bytes_per_s": HBM, "rows": rows,
              "seconds": time.perf_counter() - t0,
              "notes": "module: eager modules in a CUDA graph; chain / chain_pdl: runtime/token_step.py "
                       "without / with programmatic dependent launch; hbm_fraction: (weights + K/V read) / "
                       "4.8 TB/s over the step"}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"token-step-{gpu.replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"[token-step] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
