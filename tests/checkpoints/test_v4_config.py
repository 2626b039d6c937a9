"""DeepSeek-V4 presets and configs: real dimensions, HF round trip, errors that name the field."""
import pytest
import torch

from dspark_trt.config import ConfigError, get_preset
from dspark_trt.config import DeepSeekV4Config, DSparkV4Config
from dspark_trt.models import build_models


def test_flash_and_pro_dimensions():
    f, p = get_preset("deepseek-v4-flash-dspark"), get_preset("deepseek-v4-pro-dspark")
    assert (f.target.hidden_size, f.target.num_hidden_layers, f.target.num_attention_heads) == (4096, 43, 64)
    assert (p.target.hidden_size, p.target.num_hidden_layers, p.target.num_attention_heads) == (7168, 61, 128)
    assert (f.target.q_lora_rank, f.target.o_groups, p.target.q_lora_rank, p.target.o_groups) == (1024, 8, 1536, 16)
    assert (f.target.index_topk, p.target.index_topk) == (512, 1024)
    assert (f.target.n_routed_experts, p.target.n_routed_experts, p.target.moe_intermediate_size) == (256, 384, 3072)
    fr, pr = f.target.compress_ratios, p.target.compress_ratios
    assert len(fr) == 46 and len(pr) == 64 and fr[-3:] == [0, 0, 0] == pr[-3:]
    assert (fr[:43].count(0), fr[:43].count(4), fr[:43].count(128)) == (2, 21, 20)
    assert (pr[:61].count(0), pr[:61].count(4), pr[:61].count(128)) == (0, 30, 31)
    assert f.draft.target_layer_ids == [40, 41, 42] and p.draft.target_layer_ids == [58, 59, 60]
    assert (f.draft.markov_rank, p.draft.markov_rank, f.draft.block_size, f.draft.mask_token_id) == (256, 512, 5, 128799)
    assert f.target.vocab_size == p.target.vocab_size == 129280 and f.target.hc_mult == 4


def test_tiny_has_every_layer_kind():
    t = get_preset("deepseek-v4-tiny-dspark").target
    kinds = set(t.compress_ratios[:t.num_hidden_layers])
    assert kinds == {0, 4, 16} and 0 < t.num_hash_layers < t.num_hidden_layers


def test_hf_round_trip():
    pair = get_preset("deepseek-v4-pro-dspark")
    d = pair.draft.to_hf()
    assert d["model_type"] == "deepseek_v4"
    assert DSparkV4Config.from_hf(d) == pair.draft
    assert DeepSeekV4Config.from_hf(d) == pair.target


@pytest.mark.parametrize("field,value", [("o_groups", 3), ("scoring_func", "relu"),
                                         ("compress_ratios", [0, 1, 4, 4, 4, 0, 0, 0])])
def test_bad_target_field_is_named(field, value):
    d = get_preset("deepseek-v4-tiny-dspark").draft.to_hf()
    d[field] = value
    with pytest.raises(ConfigError, match=field):
        DeepSeekV4Config.from_hf(d)


def test_bad_draft_fields_are_named():
    d = get_preset("deepseek-v4-tiny-dspark").draft.to_hf()
    d["compress_ratios"] = d["compress_ratios"][:-1] + [4]
    with pytest.raises(ConfigError, match="compress_ratios"):
        DSparkV4Config.from_hf(d).validate()
    d = get_preset("deepseek-v4-tiny-dspark").draft.to_hf()
    del d["dspark_block_size"]
    with pytest.raises(ConfigError, match="dspark_block_size"):
        DSparkV4Config.from_hf(d)


def test_kv_bytes_per_token_matches_allocation():
    target, draft = build_models(get_preset("deepseek-v4-tiny-dspark"))
    pages, page = 3, 8
    for m in (target, draft):
        cache = m.make_cache(pages, page, torch.float32, "cpu")
        allocated = sum(t.numel() * t.element_size() for layer in cache["layers"] for t in layer.values())
        assert m.kv_bytes_per_token(torch.float32) * (pages + 1) * page == allocated


def test_override_cuts_v4_target_keeping_layer_kinds_and_draft_stages():
    """--override num_hidden_layers=K on V4: the first K layers' compress ratios stay (SWA, CSA,
    HCA), the draft stages' trailing SWA entries follow, the draft's backbone copy agrees."""
    from dspark_trt.builder.build import apply_overrides
    from dspark_trt.config import get_preset
    full = get_preset("deepseek-v4-flash-dspark")
    pair = apply_overrides(full, ["num_hidden_layers=4"])
    t, d = pair.target, pair.draft
    assert t.num_hidden_layers == 4 and t.num_hash_layers == min(full.target.num_hash_layers, 4)
    assert t.compress_ratios == full.target.compress_ratios[:4] + [0] * d.num_stages
    assert d.backbone.num_hidden_layers == 4 and d.backbone.compress_ratios == t.compress_ratios
    assert d.target_layer_ids[-1] < 4 and d.num_stages == full.draft.num_stages
    assert (d.backbone.hidden_size, d.backbone.n_routed_experts) == (full.target.hidden_size,
                                                                     full.target.n_routed_experts)
    # one target layer (benchmarks/build_gpu.py v4): a V4 tap may be the last layer, so [0] stays
    one = apply_overrides(full, ["draft.target_layer_ids=[0]", "num_hidden_layers=1"])
    assert one.target.num_hidden_layers == 1 and one.draft.target_layer_ids == [0]
    assert one.draft.num_stages == 3 and one.draft.backbone.moe_intermediate_size == 2048
