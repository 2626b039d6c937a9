"""The decode kernel chain (``runtime/token_step.py``, issue #21) against the module step, in CUDA
graphs, at Qwen3-8B dimensions (bf16, random weights, fused q/k/v and gate/up), batch 1 (``--batch
1,16``: rows of their own contexts too, e.g. issue #21's batch-16 AR step against batch 1).

Per step size T (1: an AR step; 8: the verify block of N = 7 drafts) and context length L (the
step's tokens at positions L .. L + T - 1; the cache holds random K/V below them):
- ``module``: ``Qwen3ForCausalLM.forward`` of one token, eager modules captured in a CUDA graph
  (what ``LLM``'s eager CUDA-graph AR step replays: cuBLAS GEMVs and torch elementwise kernels);
- ``chain``: ``TokenStep`` without PDL; ``chain_pdl``: with programmatic dependent launch (the
  L2 prefetches of sessions 31 and 32, ``--l2-prefetch`` and ``--gemv-prefetch``, lost or tied on an
  H100 and are gone: ``runtime/token_step.py``'s module doc);
  ``chain_pdl_attn_<variant>`` (``--attention``): with PDL and other attention launch parameters,
  ``ticket`` (the splits merged by the last-arriving split: one launch fewer) or ``s<S>`` (S KV
  splits instead of ``default_num_splits``' fill of the SMs), e.g. ``ticket,s4,s8,ticket_s8``.
Each: median ms of graph replays, the fraction of the HBM roofline (weights of every layer and the
head, plus the K/V rows read, at the GPU's HBM rate: 4.8 TB/s on the H200, 3.35 on the H100), and
the logits' agreement with the module step (the largest difference over the logits' scale, argmax
equal), and each path's agreement with the same step in fp32 (weights, cache, arithmetic;
``--no-fp32``: not), the scale of bf16's own error. With ``--draft-layers`` (default 5, the
published Qwen3-8B DSpark draft's), the draft's block pass of N = 7 tokens (the anchor and mask
tokens, non-causal over its context) the same way: ``DSparkQwen3Draft.block`` against
``TokenStep.draft_logits`` (the Markov sampler after it is the same in both, not timed here).
With ``--ablate`` (timing only, where the step's time goes: the 32 % of the AR step outside the
GEMVs' roofline, issue #21): ``chain_pdl`` again with parts of the step replaced by fixed outputs
of their shape, so the difference to ``chain_pdl`` is what that part costs inside the chain
(its kernels, launches and waits): ``minus_qk_rope`` (attention reads a fixed q; the step's K/V
are not written), ``minus_attention`` (and the o GEMV reads a fixed o: the layers are GEMVs
only), ``minus_step_ops`` (the RoPE rows' torch ops once per step).
Writes ``token-step-<gpu>-<sha>.json`` to ``--out``.

    python benchmarks/token_step_bench.py [--layers 36] [--tokens 1,8] [--contexts 128,1024,8192,32768]
        [--attention ticket,s8] [--ablate]
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

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402
from dspark_trt.config import Qwen3Config  # noqa: E402
from dspark_trt.models.fuse import fuse_projections_  # noqa: E402
from dspark_trt.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from dspark_trt.runtime import token_step  # noqa: E402
from dspark_trt.runtime.token_step import TokenStep  # noqa: E402

HBM = 4.8e12                                   # the H200's; the GPU's own in main (devices.hbm_bytes_per_s)
PAGE = 16


def build(layers: int, vocab: int, positions: int):
    """A Qwen3-8B-dims model of ``layers`` layers (bf16, weights N(0, 0.02), fused projections), its
    caches for ``positions`` positions filled with N(0, 1) K/V, and the block table's pages."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    with torch.device("cuda"):
        taps = sorted({1, layers // 2, layers - 2} & set(range(layers - 1)))    # never the last layer
        model = Qwen3ForCausalLM(cfg, tap_layer_ids=taps).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    fuse_projections_(model)
    pages = -(-positions // PAGE)
    cache = model.make_cache(pages, PAGE, torch.bfloat16, "cuda")
    for c in cache["k"] + cache["v"]:
        c.normal_()
    return model, cache, torch.arange(pages, device="cuda")


def build_draft(model, layers: int, block: int, cache_pages: int):
    """A DSpark draft of ``layers`` Qwen3-8B-dims layers over ``model``'s embedding and head
    (weights N(0, 0.02), fused projections) and its cache of ``cache_pages`` pages of N(0, 1) K/V."""
    from dspark_trt.config import DSparkConfig
    from dspark_trt.models.dspark_qwen3 import DSparkQwen3Draft
    cfg = DSparkConfig(backbone=model.config, num_hidden_layers=layers, block_size=block,
                       mask_token_id=model.config.vocab_size - 1, target_layer_ids=list(model.tap_layer_ids),
                       markov_rank=256, num_target_layers=model.config.num_hidden_layers)
    with torch.device("cuda"):
        draft = DSparkQwen3Draft(cfg, model.model.embed_tokens, model.lm_head).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2 and not name.startswith(("embed_tokens", "lm_head")):
                p.normal_(0.0, 0.02)
    fuse_projections_(draft)
    cache = draft.make_cache(cache_pages, PAGE, torch.bfloat16, "cuda")
    for c in cache["k"] + cache["v"]:
        c.normal_()
    return draft, cache


def attention_options(variant: str) -> dict:
    """``ticket`` / ``s<S>`` / ``ticket_s<S>`` -> ``block_attention_triton`` launch parameters."""
    opts = {}
    for part in variant.split("_"):
        if part == "ticket":
            opts["reduce"] = "ticket"
        elif part[:1] == "s" and part[1:].isdigit() and int(part[1:]) > 0:
            opts["num_splits"] = int(part[1:])
        else:
            raise SystemExit(f"[token-step] --attention {variant!r}: parts are ticket and s<splits>")
    return opts


def chain_steps(model, attention: list[str]) -> dict:
    """The chain's variants of ``model`` (target or draft): without / with PDL, and with PDL plus
    each attention variant."""
    steps = {"chain": TokenStep(model), "chain_pdl": TokenStep(model, pdl=True)}
    steps.update({f"chain_pdl_attn_{a}": TokenStep(model, pdl=True, attention=attention_options(a))
                  for a in attention})
    return steps


ABLATIONS = {      # path -> token_step's functions replaced by fixed outputs (no work)
    "minus_qk_rope": ("qk_rope_cache",),
    "minus_attention": ("qk_rope_cache", "block_attention_triton"),
    "minus_step_ops": ("rope_cos_sin",),
}


def ablated(fn, names: tuple[str, ...]):
    """``fn`` with ``token_step``'s functions ``names`` standing in as fixed tensors of their
    outputs' shapes while it runs (its warm-up and CUDA-graph capture): timing only."""
    fixed: dict = {}

    def const(shape, dtype, device):
        key = (tuple(shape), dtype)
        if key not in fixed:
            fixed[key] = torch.randn(shape, device=device).to(dtype)
        return fixed[key]

    stand_ins = {
        "qk_rope_cache": lambda qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, table, pos, heads, eps, **_: const(
            (pos.numel(), heads, k_cache.shape[3]), qkv.dtype, qkv.device),
        "block_attention_triton": lambda q, *_, **__: const(q.shape, q.dtype, q.device),
        "rope_cos_sin": lambda pos, dim, theta, dtype: (const((*pos.shape, 1, dim), dtype, pos.device),) * 2,
    }

    def run():
        saved = {n: getattr(token_step, n) for n in names}
        try:
            for n in names:
                setattr(token_step, n, stand_ins[n])
            return fn()
        finally:
            for n, f in saved.items():
                setattr(token_step, n, f)
    return run


def ablation_times(fn, base_ms: float, iters: int) -> dict:
    """Each ``ABLATIONS`` path of ``fn`` (a ``chain_pdl`` step): its ms and what the part left out
    costs inside the chain (``base_ms`` - ms)."""
    out = {}
    for name, names in ABLATIONS.items():
        ms = graph_us([ablated(fn, names)], iters) / 1e3
        out[name] = {"ms": ms, "part_ms": base_ms - ms}
    return out


def add_ablations(row: dict, fn, out: dict, iters: int, head: str) -> None:
    """``row["ablations"]``: ``ablation_times`` of the row's ``chain_pdl`` step ``fn``, printed."""
    with torch.inference_mode():
        abl = row["ablations"] = ablation_times(fn, out["chain_pdl"]["ms"], iters)
    print(f"[token-step] {head} ablations (chain_pdl minus part: ms, the part's cost) | " + " | ".join(
        f"{k} {v['ms']:.3f} ms ({v['part_ms']:+.3f})" for k, v in abl.items()), flush=True)


def time_paths(fns: dict, bytes_: float, iters: int, exact=None) -> dict:
    """Each path's median CUDA-graph replay, its HBM fraction of ``bytes_`` and its output's
    agreement with the first path's (the reference); with ``exact`` (the same step in fp32: weights,
    cache and arithmetic) each path's too, so the paths' distance from each other reads against
    the bf16 module's own distance from fp32."""
    out = {"roofline_ms": bytes_ / HBM * 1e3}
    ref = next(iter(fns.values()))().float()
    ref32 = None
    if exact is not None:
        try:                                  # a reference that cannot run (e.g. fp32 tiles past shared
            ref32 = exact().float()           # memory) costs the comparison, not the timings
        except Exception as e:                # noqa: BLE001 - reported in the JSON and the line
            out["fp32_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for name, fn in fns.items():
        logits = fn().float()
        ms = graph_us([fn], iters) / 1e3
        out[name] = {"ms": ms, "hbm_fraction": bytes_ / HBM / (ms * 1e-3), **agreement(logits, ref)}
        if ref32 is not None:
            out[name].update({f"fp32_{k}": v for k, v in agreement(logits, ref32).items()})
    return out


def agreement(logits, ref) -> dict:
    return {"logit_err": float((logits - ref).abs().max() / ref.abs().max()),
            "argmax_equal": bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))}


def fp32_copy(model, cache: dict):
    """``model`` and its cache in fp32 (the exact reference of ``time_paths``)."""
    import copy
    return copy.deepcopy(model).float(), {k: [c.float() for c in v] for k, v in cache.items()}


def report_line(head: str, out: dict) -> str:
    eq = lambda v, k: "=" if v[k] else "!="                                      # noqa: E731
    return f"[token-step] {head} roofline {out['roofline_ms']:.3f} ms | " + " | ".join(
        f"{k} {v['ms']:.3f} ms ({100 * v['hbm_fraction']:.1f} %, err {v['logit_err']:.3g}, "
        f"argmax {eq(v, 'argmax_equal')}" + (f"; vs fp32 {v['fp32_logit_err']:.3g} {eq(v, 'fp32_argmax_equal')}"
                                              if "fp32_logit_err" in v else "") + ")"
        for k, v in out.items() if isinstance(v, dict)) + (f" | fp32 reference failed: {out['fp32_error']}"
                                                            if "fp32_error" in out else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--contexts", default="128,1024,8192,32768")
    ap.add_argument("--tokens", default="1,8", help="tokens per step: 1 (AR), 8 (a verify block of N = 7)")
    ap.add_argument("--batch", default="1", help="rows per step, comma-separated (each its own context of the "
                    "same length and its own pages; batch x tokens <= 16; the cache holds batch x context "
                    "positions: 4 KiB each per layer at Qwen3-8B dims)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--draft-layers", type=int, default=5, help="the draft's block pass too (0: not)")
    ap.add_argument("--no-fp32", action="store_true", help="no fp32 reference (it holds a second, fp32 copy)")
    ap.add_argument("--attention", default="", help="attention variants, comma-separated: ticket, s<S>, "
                    "ticket_s<S> (a chain_pdl_attn_<variant> path each)")
    ap.add_argument("--ablate", action="store_true", help="also time chain_pdl without parts of the step "
                    "(timing only: where the step's time goes)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("[token-step] needs a CUDA GPU")
    global HBM
    HBM = hbm_bytes_per_s()
    t0 = time.perf_counter()
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = [int(t) for t in args.tokens.split(",")]
    attention = [a for a in args.attention.split(",") if a]
    for a in attention:                                              # a bad variant fails before the build
        attention_options(a)
    batches = [int(b) for b in args.batch.split(",")]
    span = -(-(max(contexts) + max(blocks)) // PAGE) * PAGE         # positions a row's own pages hold
    model, cache, pages = build(args.layers, args.vocab, span * max(batches))
    table = pages.view(max(batches), -1)                             # [rows, P]: each row its own pages
    steps = chain_steps(model, attention)
    chain = steps["chain"]                                           # the bytes a step must read
    weight_bytes = sum(t.numel() * t.element_size() for w in chain.layers for t in vars(w).values()) + sum(
        t.numel() * t.element_size() for t in (chain.lm_head, chain.final_norm))
    kv_row = 2 * 8 * 128 * 2                                         # K and V of one position, one layer
    model32, cache32 = (None, None) if args.no_fp32 else fp32_copy(model, cache)
    rows = []
    for B, T in [(B, T) for B in batches for T in blocks if B * T <= TokenStep.max_rows]:
        tokens = torch.randint(0, args.vocab, (B, T), device="cuda")
        bt = table[:B]
        for L in contexts:
            pos = (L + torch.arange(T, device="cuda")[None]).expand(B, T).contiguous()
            with torch.inference_mode():
                fns = {"module": lambda: model(tokens, pos, bt, cache)[0]}
                fns.update({k: (lambda s=s: s(tokens, pos, cache, bt)[0]) for k, s in steps.items()})
                exact = None if model32 is None else (lambda: model32(tokens, pos, bt, cache32)[0])
                out = time_paths(fns, weight_bytes + args.layers * B * (L + T) * kv_row, args.iters, exact)
            rows.append({"batch": B, "tokens": T, "context": L, **out})
            head = (f"B={B} " if len(batches) > 1 else "") + f"T={T} L={L:6d}"
            print(report_line(head, out), flush=True)
            if args.ablate:
                add_ablations(rows[-1], fns["chain_pdl"], out, args.iters, head)
    draft_rows = []
    if args.draft_layers:
        N = 7
        draft, dcache = build_draft(model, args.draft_layers, N, table.shape[1])
        dsteps = chain_steps(draft, attention)
        d = dsteps["chain"]
        draft_bytes = sum(t.numel() * t.element_size() for w in d.layers for t in vars(w).values()) + sum(
            t.numel() * t.element_size() for t in (d.lm_head, d.final_norm))
        anchor = torch.randint(0, args.vocab - 1, (1,), device="cuda")
        del model32, cache32
        draft32, dcache32 = (None, None) if args.no_fp32 else fp32_copy(draft, dcache)
        for L in contexts:
            start = torch.tensor([L], device="cuda")
            with torch.inference_mode():
                fns = {"module": lambda: draft.block(anchor, start, table[:1], dcache, N)}
                fns.update({k: (lambda s=s: s.draft_logits(anchor, start, dcache, table[:1], N))
                            for k, s in dsteps.items()})
                exact = None if draft32 is None else (lambda: draft32.block(anchor, start, table[:1], dcache32, N))
                out = time_paths(fns, draft_bytes + args.draft_layers * (L + N) * kv_row, args.iters, exact)
            draft_rows.append({"block": N, "context": L, **out})
            print(report_line(f"draft block N={N} L={L:6d}", out), flush=True)
            if args.ablate:
                add_ablations(draft_rows[-1], fns["chain_pdl"], out, args.iters, f"draft block N={N} L={L:6d}")
    sha = provenance.git_sha()
    gpu = torch.cuda.get_device_name()
    report = {"git_sha": sha, "gpu": gpu, "command": "python benchmarks/token_step_bench.py " + " ".join(sys.argv[1:]),
              "shapes": {"layers": args.layers, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                         "intermediate": 12288, "vocab": args.vocab, "dtype": "bf16", "batch": batches, "page": PAGE,
                         "tokens_per_step": blocks, "contexts": contexts},
              "weight_bytes": weight_bytes, "hbm_bytes_per_s": HBM, "rows": rows,
              "draft": {"layers": args.draft_layers, "rows": draft_rows},
              "seconds": time.perf_counter() - t0,
              "attention_variants": {a: attention_options(a) for a in attention},
              "notes": "module: eager modules in a CUDA graph; chain / chain_pdl: runtime/token_step.py "
                       "without / with programmatic dependent launch; hbm_fraction: "
                       f"(weights + K/V read) / {HBM / 1e12:.2f} TB/s over the step"}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"token-step-{gpu.replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"[token-step] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
