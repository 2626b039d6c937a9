"""``dspark-trt info``: an engine's manifest, or a preset's memory estimate."""
from __future__ import annotations

import json
import math

import torch

from ..config.dtypes import DTYPES, ENGINE_DTYPES
from ..config.source import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, add_source_args

H200_BYTES = 141e9


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="print an engine's manifest or a preset's memory estimate")
    p.add_argument("engine_dir", nargs="?", help="engine directory")
    add_source_args(p, ("model", "dtype", "max_batch_size", "max_seq_len"),
                    model=dict(help="preset name: print a memory estimate instead"),
                    dtype=dict(choices=sorted(ENGINE_DTYPES), default="bf16", help="for --model"),
                    max_batch_size=dict(default=DEFAULT_MAX_BATCH_SIZE, help="for --model"),
                    max_seq_len=dict(default=DEFAULT_MAX_SEQ_LEN, help="for --model"))
    p.add_argument("--no-verify", action="store_true", help="skip file checksums (engine)")
    p.set_defaults(func=run)


def run(args) -> int:
    if bool(args.engine_dir) == bool(args.model):
        raise SystemExit("error: give either ENGINE_DIR or --model NAME")
    if args.model:
        est = memory_estimate(args.model, DTYPES[args.dtype], args.max_batch_size, args.max_seq_len)
        print(json.dumps(est, indent=2))
        return 0
    from ..engine.manifest import EngineError, check_engine, read_manifest
    m = read_manifest(args.engine_dir)
    print(json.dumps(m, indent=2))
    for line in ops_summary(m):
        print(line)
    built_for = torch.device("cuda" if m.get("device", {}).get("type") == "cuda" else "cpu")
    try:
        if built_for.type == "cuda" and not torch.cuda.is_available():
            print("check: skipped (engine built for cuda, no GPU here)")
        else:
            check_engine(args.engine_dir, built_for, verify_checksums=not args.no_verify)
            print("check: ok")
    except EngineError as e:
        print(f"check: FAILED: {e}")
        return 2
    return 0


def ops_summary(manifest: dict) -> list[str]:
    """One line per network (and rank): its dspark ops as Triton kernels or PyTorch references."""
    parts = manifest.get("ranks") or [manifest]
    lines = []
    for r, part in enumerate(parts):
        for net, spec in part.get("networks", {}).items():
            ops = spec.get("ops")
            if ops is None:
                continue
            where = f"{net} (rank {r})" if len(parts) > 1 else net
            lines.append(f"ops {where}: " + ("; ".join(f"{op} = {how}" for op, how in ops.items()) or "none"))
    return lines


ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "q_lora_rank", "o_lora_rank", "sliding_window", "index_topk",
               "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "hc_mult",
               "max_position_embeddings")
DRAFT_FIELDS = ("num_hidden_layers", "num_stages", "block_size", "target_layer_ids", "markov_rank",
                "mask_token_id", "enable_confidence_head")


def architecture(pair) -> dict:
    """The dimensions a user compares against the model card (fields the config has)."""
    pick = lambda cfg, names: {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}  # noqa: E731
    draft = pick(pair.draft, DRAFT_FIELDS)
    draft["backbone"] = pick(pair.draft.backbone, ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim", "intermediate_size"))
    return {"target": {"arch": pair.target.arch, **pick(pair.target, ARCH_FIELDS)},
            "draft": {"arch": pair.draft.arch, **draft}}


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """model.kv_bytes_per_token(dtype) when the model defines it, else K+V of every layer (Qwen3)."""
    if hasattr(model, "kv_bytes_per_token"):
        return int(model.kv_bytes_per_token(dtype))
    c = model.config.layer_config() if hasattr(model.config, "layer_config") else model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype.itemsize


def memory_estimate(name: str, dtype: torch.dtype, max_batch_size: int, max_seq_len: int) -> dict:
    """Parameters counted on the meta device (shared tensors once), KV per token, H200s needed."""
    from ..config import get_preset
    from ..models import build_models
    pair = get_preset(name)
    target, draft = build_models(pair, dtype, "meta", seed=None)
    seen, by_dtype, params = set(), {}, {}
    for net, module in (("target", target), ("draft", draft)):
        count = 0
        for p in module.parameters():            # parameters() already skips tied duplicates per module
            if id(p) in seen:
                continue
            seen.add(id(p))
            count += p.numel()
            key = str(p.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + p.numel()
        params[net] = count
    weight_bytes = sum(n * getattr(torch, d).itemsize for d, n in by_dtype.items())
    kv = {"target": kv_bytes_per_token(target, dtype), "draft": kv_bytes_per_token(draft, dtype)}
    kv_full = sum(kv.values()) * max_batch_size * max_seq_len
    total = weight_bytes + kv_full
    return {"model": name, "dtype": str(dtype).removeprefix("torch."),
            "architecture": architecture(pair), "parameters": params, "parameters_by_dtype": by_dtype,
            "weight_bytes": weight_bytes, "weight_gb": round(weight_bytes / 1e9, 3),
            "kv_bytes_per_token": kv,
            "kv_gb_full_batch": round(kv_full / 1e9, 3),
            "full_batch": {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len},
            "h200_count": max(1, math.ceil(total / H200_BYTES)),
            "note": "weights + KV of a full batch at max_seq_len over 141 GB per H200; "
                    "activations and workspace not included"}
