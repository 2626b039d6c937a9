"""The HF transformers peer of ``dspark-trt bench``: plain greedy decoding of the same target.

A transformers ``Qwen3ForCausalLM`` is built from our ``Qwen3Config`` (``to_hf()``) and given the
very same weights, then timed with ``generate``. The weights come from ``LLM``'s target modules
(fused projections split back into HF names) or, on the engine path, from the engine directory
(``engine_target_state``: an AOTI engine's ``weights.safetensors``; a random-weights engine without
that file: rebuilt from its seed). Modes:
  * ``eager``    : default (dynamic) cache, no compilation,
  * ``compiled`` : static cache, which makes ``generate`` torch.compile the decoding forward.
Decode throughput excludes the prefill: ``B * (n - 1) / (t(n new tokens) - t(1 new token))``.
"""
from __future__ import annotations

import time

import torch

HF_MODES = ("eager", "compiled")


def transformers_missing_reason() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        return "HF transformers is not installed (pip install transformers to compare with it)"
    return None


def build_hf_qwen3(target, cfg) -> torch.nn.Module:
    """transformers Qwen3ForCausalLM with config ``cfg`` and the weights of ``target``: our target
    module (fused projections split back into HF names) or a state dict in HF names."""
    import transformers
    from dspark_trt.models.fuse import unfused_state_dict
    state = target if isinstance(target, dict) else unfused_state_dict(target)
    d = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype")}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.Qwen3Config(**d)
    p = next(iter(state.values()))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(p.dtype)
    try:
        with torch.device(p.device):
            model = transformers.Qwen3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"HF Qwen3 parameter names differ from ours: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.eval().requires_grad_(False)


def engine_target_state(engine_dir, manifest: dict, pair, device) -> tuple[dict, str]:
    """The target's weights of an engine directory in HF names, and where they came from:
    an AOTI engine's weights file (the target network's constants), or, for a random-weights
    engine without one, the same seed rebuilt (``models.build_models``, as the build did)."""
    from pathlib import Path
    from dspark_trt.models.fuse import qwen3_fused_sizes, unfuse_state_dict
    if manifest.get("tp_size", 1) > 1:
        raise ValueError("a tensor-parallel engine holds its weights per rank")
    net = manifest.get("networks", {}).get("target", {})
    if manifest.get("backend") == "aoti" and manifest.get("weights") and net.get("constants"):
        from safetensors import safe_open
        with safe_open(str(Path(engine_dir) / manifest["weights"]), framework="pt", device=str(device)) as f:
            state = {fqn.removeprefix("target."): f.get_tensor(stored)
                     for fqn, stored in net["constants"].items() if fqn.startswith("target.")}
        return unfuse_state_dict(state, qwen3_fused_sizes(pair.target)), "engine weights file"
    opts = manifest.get("build_options", {})
    if opts.get("random_weights") and not opts.get("checkpoint"):
        from dspark_trt.config.dtypes import DTYPES
        from dspark_trt.models import build_models
        seed = opts.get("seed", 0)
        target, _ = build_models(pair, DTYPES[manifest["dtype"]], device, seed=seed)
        return target.state_dict(), f"random weights rebuilt from seed {seed}"
    raise ValueError(f"backend {manifest.get('backend')!r} keeps its weights inside its plans and the "
                     f"engine was built from {opts.get('checkpoint')}: give --checkpoint to compare")


def _generate(model, ids: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                          pad_token_id=0, eos_token_id=model.config.eos_token_id or None,
                          cache_implementation="static" if mode == "compiled" else None,
                          disable_compile=mode != "compiled")
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)


def _timed(model, ids, n, mode) -> tuple[float, torch.Tensor]:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = _generate(model, ids, n, mode)
    sync()
    return time.perf_counter() - t0, out


def measure_hf_decode(model, prompts: torch.Tensor, gen_len: int, mode: str) -> dict:
    """prompts [B, T] int64 on the model's device -> decode tokens/s and the generated ids."""
    if mode not in HF_MODES:
        raise ValueError(f"unknown HF mode '{mode}' (choose from {HF_MODES})")
    if gen_len < 2:
        raise ValueError("gen_len must be >= 2 to separate decoding from the prefill")
    t_warm, _ = _timed(model, prompts, gen_len, mode)          # compiles / captures in "compiled"
    _timed(model, prompts, 1, mode)
    t_full, out = _timed(model, prompts, gen_len, mode)
    t_one, _ = _timed(model, prompts, 1, mode)
    B = prompts.shape[0]
    decode_s = max(t_full - t_one, 1e-9)
    return {"mode": mode, "batch_size": B, "gen_len": gen_len,
            "decode_tokens_per_s": B * (gen_len - 1) / decode_s,
            "decode_step_ms": decode_s / (gen_len - 1) * 1e3,
            "first_call_s": t_warm, "output_ids": out[:, prompts.shape[1]:].tolist()}
