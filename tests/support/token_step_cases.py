"""``runtime.token_step.TokenStep`` under ``TRITON_INTERPRET=1`` (run as a subprocess by
tests/runtime/test_token_step.py): a tiny bf16 Qwen3 target (fused and unfused projections, taps
of the first and a middle layer) prefilled by its own forward, then one decode token through the
kernel chain and through the module's forward on a copy of the caches. Prints ``RESULT {json}``:
per case the logits' largest error over their scale, whether the argmax agrees, the taps' and
the written K / V's errors in bf16 ulps, and whether anything besides the token's cache rows
changed."""
from __future__ import annotations

import json
import os

import torch

from tests.support.skinny_gemm_cases import ulp_err

# (name, layers, taps, fused, prompt tokens)
CASES = [
    ("unfused_taps_first_and_mid", 3, (0, 1), False, 5),
    ("fused_tap_first_page_boundary", 2, (0,), True, 8),
]


def attention_in_fp32(kernel):
    """The attention kernel on fp32 copies of q and the caches, its output rounded to bf16: under
    the interpreter its bf16 path returns garbage (its fp32 path matches the reference, tests/
    support/plugins_cases.py; bf16 runs on the GPU, tests/plugins/test_plugins_gpu.py)."""
    def run(q, k_cache, v_cache, *args, **kw):
        return kernel(q.float(), k_cache.float(), v_cache.float(), *args, **kw).to(q.dtype)
    return run


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1"          # set before triton is imported
    from dspark_trt.models import build_models
    from dspark_trt.models.fuse import fuse_projections_
    from dspark_trt.runtime import token_step
    from dspark_trt.runtime.token_step import TokenStep
    from tests.support.models import scale_weights_, tiny_pair
    token_step.block_attention_triton = attention_in_fp32(token_step.block_attention_triton)
    out = {}
    for i, (name, layers, taps, fused, T) in enumerate(CASES):
        pair = tiny_pair(vocab=96, hidden=64, layers=layers, heads=4, kv_heads=2, taps=taps)
        target, _ = build_models(pair, torch.bfloat16, "cpu", seed=i)
        scale_weights_(target, 4.0)
        if fused:
            fuse_projections_(target)
        page, pages = 4, 8
        cache = target.make_cache(pages, page, torch.bfloat16, "cpu")
        table = torch.tensor([[5, 2, 7, 0, -1, -1]])
        prompt = torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            target(prompt, torch.arange(T)[None], table, cache)
            ref_cache = {k: [c.clone() for c in v] for k, v in cache.items()}
            token, pos = torch.tensor([17]), torch.tensor([T])
            ref_logits, ref_taps = target(token[None], pos[None], table, ref_cache)
            logits, tap = TokenStep(target)(token, pos, cache, table[0])
        ref_logits, ref_taps = ref_logits[0, 0].float(), ref_taps[0, 0]
        row = table[0, T // page].item() * page + T % page
        changed_elsewhere = False
        kv_ulp = 0.0
        for kind in ("k", "v"):
            for a, b in zip(cache[kind], ref_cache[kind]):
                a2, b2 = a.reshape(-1, *a.shape[2:]).clone(), b.reshape(-1, *b.shape[2:]).clone()
                kv_ulp = max(kv_ulp, ulp_err(a2[row], b2[row].float()))
                a2[row], b2[row] = 0, 0
                changed_elsewhere |= not torch.equal(a2, b2)
        out[name] = {
            "logit_err": float((logits.float() - ref_logits).abs().max() / ref_logits.abs().max()),
            "argmax_equal": int(logits.float().argmax()) == int(ref_logits.argmax()),
            "taps_shape": list(tap.shape), "ref_taps_shape": list(ref_taps.shape),
            "taps_ulp": ulp_err(tap, ref_taps.float()) if tap.numel() else 0.0,
            "kv_ulp": kv_ulp, "cache_changed_elsewhere": changed_elsewhere,
            "logits_dtype": str(logits.dtype),
        }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
