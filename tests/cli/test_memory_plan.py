"""``dspark-trt info --model``'s native-precision memory plan (issue #23) against a hand
computation from the DeepSeek-V4 configs: fp8 blocks (1 B + one E8M0 byte per 128 x 128) for the
attention projections, the CSA layers' indexer wq_b, shared experts and main_proj; MXFP4 (0.5 B +
one E8M0 byte per 32) for the routed experts; everything else in bf16."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from dspark_trt.commands import info

memory_estimate = functools.lru_cache(info.memory_estimate)   # V4-Pro on the meta device: ~20 s once
from dspark_trt.config import get_preset


def fp8_bytes(N: int, K: int) -> int:
    return N * K + math.ceil(N / 128) * math.ceil(K / 128)


def hand_plan(name: str) -> dict:
    """{fp8: (params, bytes), mxfp4: (params, bytes)} from the config fields alone."""
    pair = get_preset(name)
    c, stages = pair.target, pair.draft.num_stages
    d, H, hd, q, o, g = (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank,
                         c.o_groups)
    h = c.moe_intermediate_size
    attn = [(q, d), (H * hd, q), (hd, d), (g * o, H * hd // g), (d, g * o)]      # wq_a wq_b wkv wo_a wo_b
    shared = [(h * c.n_shared_experts, d), (d, h * c.n_shared_experts), (h * c.n_shared_experts, d)]
    indexer = [(c.index_n_heads * c.index_head_dim, q)]
    csa = sum(1 for r in c.compress_ratios[:c.num_hidden_layers] if r == 4)
    layers = c.num_hidden_layers + stages                                       # target + draft stages
    mats = attn * layers + shared * layers + indexer * csa + [(d, len(pair.draft.target_layer_ids) * d)]
    fp8 = (sum(n * k for n, k in mats), sum(fp8_bytes(n, k) for n, k in mats))
    experts = layers * c.n_routed_experts * 3 * d * h
    return {"fp8": fp8, "mxfp4": (experts, experts // 2 + experts // 32)}


@pytest.mark.parametrize("name, gpus, fits", [("deepseek-v4-pro-dspark", 8, True),
                                              ("deepseek-v4-flash-dspark", 2, True)])
def test_native_weights_match_the_hand_computation(name, gpus, fits):
    B, S = 8, 2048
    est = memory_estimate(name, torch.bfloat16, B, S)
    plan, hand = est["native_precision"], hand_plan(name)
    assert plan["formats"]["fp8_e4m3_block128"] == {"params": hand["fp8"][0], "bytes": hand["fp8"][1]}
    assert plan["formats"]["mxfp4_e2m1_group32"] == {"params": hand["mxfp4"][0], "bytes": hand["mxfp4"][1]}
    quantised = hand["fp8"][0] + hand["mxfp4"][0]
    bf16 = est["weight_bytes"] - 2 * quantised                     # the rest stays bf16
    assert plan["weight_bytes"] == bf16 + hand["fp8"][1] + hand["mxfp4"][1]
    kv_full = sum(est["kv_bytes_per_token"].values()) * B * S
    per_gpu = plan["weight_bytes"] / 8 + kv_full                   # the MLA latent: replicated per rank
    assert plan["one_node"]["gb_per_gpu"] == round(per_gpu / 1e9, 3)
    assert plan["one_node"]["fits"] is fits and plan["gpus_needed"] == gpus
    assert plan["one_node"]["kv_replicated"]
    assert ("one 8 x H200 node holds it" in plan["verdict"]) is fits


def test_v4_pro_is_about_0_9_tb_native_against_3_3_tb_bf16():
    est = memory_estimate("deepseek-v4-pro-dspark", torch.bfloat16, 8, 2048)
    assert 3.2e12 < est["weight_bytes"] < 3.4e12 and est["h200_count"] == 24
    assert 0.85e12 < est["native_precision"]["weight_bytes"] < 0.95e12
    assert "needs 8 H200s (one 8 x H200 node)" in est["native_precision"]["verdict"]


def test_qwen3_fp8_preset_counts_fp32_block_scales():
    est = memory_estimate("qwen3-8b-fp8-dspark-block7", torch.bfloat16, 1, 128)
    c = get_preset("qwen3-8b-fp8-dspark-block7").target
    d, q, kv, m = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    mats = [(q, d), (kv, d), (kv, d), (d, q), (m, d), (m, d), (d, m)] * c.num_hidden_layers
    want = sum(n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) for n, k in mats)
    assert est["native_precision"]["formats"]["fp8_e4m3_block128"]["bytes"] == want
    assert est["native_precision"]["gpus_needed"] == 1


def test_replicated_kv_that_fits_no_gpu_is_said():
    plan = memory_estimate("deepseek-v4-tiny-dspark", torch.bfloat16, 64, 10 ** 9)["native_precision"]
    assert plan["gpus_needed"] is None and "lower --max-batch-size" in plan["verdict"]


def test_mxfp4_plan_is_what_quantization_fp8_holds():
    """``--quantization fp8`` holds the target's routed experts in exactly the bytes the plan
    counts for them (stacked packed nibbles + E8M0 scales: 0.5 B + 1 B per 32 weights)."""
    from dspark_trt.checkpoints.prepare import prepare_models
    from dspark_trt.config.source import ModelSource
    from dspark_trt.models import build_models
    name = "deepseek-v4-tiny-dspark"
    pair = get_preset(name)
    meta, _ = build_models(pair, torch.bfloat16, "meta", seed=None)
    fmts = {n: info.native_format(pair, "target", n) for n, _ in meta.named_parameters()}
    planned = sum(info.native_bytes(info.MXFP4, p.shape, torch.bfloat16, 1)
                  for n, p in meta.named_parameters() if fmts[n] == info.MXFP4)
    _, target, _ = prepare_models(ModelSource(model=name, quantization="fp8"), torch.float32, "cpu")
    held = {n: b for n, b in target.named_buffers() if n.endswith(("w13_packed", "w13_scale", "w2_packed", "w2_scale"))}
    assert len(held) == 4 * pair.target.num_hidden_layers
    assert sum(b.numel() * b.element_size() for b in held.values()) == planned > 0
