"""``dspark-trt info``: an engine's manifest, or a preset's memory estimate."""
from __future__ import annotations

import json
import math

import torch

from ..config.dtypes import DTYPES, ENGINE_DTYPES
from ..config.source import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, add_source_args

H200_BYTES = 141e9
GPUS_PER_NODE = 8
FP8 = "fp8_e4m3_block128"                 # 1 B / weight + one scale per 128 x 128 block
MXFP4 = "mxfp4_e2m1_group32"              # 0.5 B / weight + one E8M0 byte per 32 weights


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
        print(est["native_precision"]["verdict"])
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


def fp8_latent_kv(target, draft, dtype: torch.dtype) -> dict | None:
    """KV bytes per token with ``--kv-cache-dtype fp8_ds_mla`` (MLA latent rows in fp8), None for
    a model without MLA attention."""
    from ..models.mla_fp8 import FORMAT
    from ..models.v4_attention import set_kv_format
    if not set_kv_format(target, FORMAT):
        return None
    set_kv_format(draft, FORMAT)
    kv = {"target": kv_bytes_per_token(target, dtype), "draft": kv_bytes_per_token(draft, dtype)}
    set_kv_format(target, "auto"), set_kv_format(draft, "auto")
    return kv


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
    kv_fp8 = fp8_latent_kv(target, draft, dtype)
    total = weight_bytes + kv_full
    native = native_plan(pair, target, draft, dtype, kv_full, name)
    return {"model": name, "dtype": str(dtype).removeprefix("torch."),
            "architecture": architecture(pair), "parameters": params, "parameters_by_dtype": by_dtype,
            "weight_bytes": weight_bytes, "weight_gb": round(weight_bytes / 1e9, 3),
            "kv_bytes_per_token": kv,
            **({"kv_bytes_per_token_fp8_ds_mla": kv_fp8} if kv_fp8 else {}),
            "kv_gb_full_batch": round(kv_full / 1e9, 3),
            "full_batch": {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len},
            "h200_count": max(1, math.ceil(total / H200_BYTES)),
            "native_precision": native,
            "note": "weights (at --dtype; native_precision: as the checkpoint stores them) + KV of a "
                    "full batch at max_seq_len over 141 GB per H200; activations and workspace not "
                    "included"}


def native_format(pair, net: str, name: str) -> str | None:
    """The checkpoint format of parameter ``name`` of ``net`` ("target" / "draft"): FP8, MXFP4, or
    None (the model dtype). DeepSeek-V4: the release's (``checkpoints.v4``: fp8 blocks for
    attention / indexer wq_b / shared experts / main_proj, routed experts in ``expert_dtype``);
    Qwen3 with ``quantization="fp8"``: the target's attention / MLP projections."""
    if pair.target.arch == "deepseek_v4":
        from ..checkpoints.v4 import _EXPERT_WEIGHT, FP8_WEIGHTS
        if _EXPERT_WEIGHT.search(name):
            return {"fp4": MXFP4, "fp8": FP8}.get(pair.target.expert_dtype)
        local = name.split(".", 2)[-1] if net == "draft" and name.startswith("layers.") else name
        return FP8 if FP8_WEIGHTS.search(local) or FP8_WEIGHTS.search(name) else None
    if getattr(pair.target, "quantization", None) == "fp8" and net == "target":
        from ..models.fp8_linear import FP8_PROJECTIONS
        parts = name.split(".")
        return FP8 if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in FP8_PROJECTIONS else None
    return None


def native_bytes(fmt: str | None, shape, dtype: torch.dtype, scale_bytes: int) -> int:
    """Bytes of one parameter stored in ``fmt`` (None: ``dtype``)."""
    n = math.prod(shape)
    if fmt == FP8:
        return n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128) * scale_bytes
    if fmt == MXFP4:
        return n // 2 + n // 32
    return n * dtype.itemsize


def native_plan(pair, target, draft, dtype: torch.dtype, kv_full: int, name: str) -> dict:
    """Weights at native precision, the H200s they need with the KV of a full batch (the fewest of
    1, 2, 4, 8, then whole nodes of 8), and whether one node of 8 holds them. Weights are split
    evenly over the GPUs (TP x EP); a single-head KV latent, as DeepSeek-V4's MLA has, is
    replicated on every rank, other KV split by heads."""
    scale_bytes = 1 if pair.target.arch == "deepseek_v4" else 4      # E8M0 (V4) / fp32 (Qwen3-FP8)
    seen, formats = set(), {}
    for net, module in (("target", target), ("draft", draft)):
        for pname, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            fmt = native_format(pair, net, pname)
            key = fmt or str(dtype).removeprefix("torch.")
            f = formats.setdefault(key, {"params": 0, "bytes": 0})
            f["params"] += p.numel()
            f["bytes"] += native_bytes(fmt, p.shape, dtype, scale_bytes)
    weights = sum(f["bytes"] for f in formats.values())
    replicated = getattr(pair.target, "num_key_value_heads", 1) == 1

    def per_gpu(g: int) -> tuple[float, float]:                     # (weights, KV) bytes per GPU
        return weights / g, kv_full if replicated else kv_full / g

    gpus = next((g for g in (1, 2, 4, 8, *range(16, 4097, 8)) if sum(per_gpu(g)) <= H200_BYTES), None)
    node_w, node_kv = per_gpu(GPUS_PER_NODE)
    fits = node_w + node_kv <= H200_BYTES
    if gpus is None:                        # the replicated KV alone does not fit one GPU
        return {"weight_bytes": weights, "weight_gb": round(weights / 1e9, 3), "formats": formats,
                "scale_bytes": scale_bytes, "gpus_needed": None, "nodes_needed": None,
                "verdict": f"{name}: the KV of the full batch ({node_kv / 1e9:.1f} GB, replicated on every "
                           f"rank) does not fit one {H200_BYTES / 1e9:.0f} GB H200 at any GPU count: "
                           "lower --max-batch-size or --max-seq-len"}
    nodes = -(-gpus // GPUS_PER_NODE)
    w_g, kv_g = per_gpu(gpus)
    where = (f"one {GPUS_PER_NODE} x H200 node" if gpus == GPUS_PER_NODE else
             f"{nodes} nodes of {GPUS_PER_NODE} H200s" if nodes > 1 else f"{gpus} of one node's H200s")
    verdict = (f"{name} at native precision needs {gpus} H200{'s' if gpus > 1 else ''} ({where}): "
               f"{(w_g + kv_g) / 1e9:.1f} GB of {H200_BYTES / 1e9:.0f} GB per GPU ({w_g / 1e9:.1f} GB weights + "
               f"{kv_g / 1e9:.1f} GB KV); one {GPUS_PER_NODE} x H200 node {'holds' if fits else 'does not hold'} it")
    return {"weight_bytes": weights, "weight_gb": round(weights / 1e9, 3), "formats": formats,
            "scale_bytes": scale_bytes,
            "h200_count": max(1, math.ceil((weights + kv_full) / H200_BYTES)),
            "gpus_needed": gpus, "nodes_needed": nodes,
            "one_node": {"gpus": GPUS_PER_NODE, "weight_gb_per_gpu": round(node_w / 1e9, 3),
                         "kv_gb_per_gpu": round(node_kv / 1e9, 3), "kv_replicated": replicated,
                         "gb_per_gpu": round((node_w + node_kv) / 1e9, 3), "fits": fits},
            "verdict": verdict}
