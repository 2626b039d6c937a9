"""The HF transformers peer of ``dspark-trt bench``: plain greedy decoding of the same target.

A transformers ``Qwen3ForCausalLM`` is built from our ``Qwen3Config`` (``to_hf()``) and given the
very same weights (our parameter names equal HF's), then timed with ``generate``:
  * ``eager``    : default (dynamic) cache, no compilation,
  * ``compiled`` : static cache, which makes ``generate`` torch.compile the decoding forward.
Decode throughput excludes the prefill: ``B * (n - 1) / (t(n new tokens) - t(1 new token))``.
"""
from __future__ import annotations

import time

import torch

HF_MODES = ("eager", "compiled")


def build_hf_qwen3(target: torch.nn.Module, cfg) -> torch.nn.Module:
    """transformers Qwen3ForCausalLM with ``target``'s config, dtype, device and weights."""
    import transformers
    d = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype")}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.Qwen3Config(**d)
    p = next(target.parameters())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(p.dtype)
    try:
        with torch.device(p.device):
            model = transformers.Qwen3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF Qwen3 parameter names differ from ours: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.eval().requires_grad_(False)


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
