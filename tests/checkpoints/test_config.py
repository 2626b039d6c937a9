import dataclasses

import pytest

from dspark_trt.config import (ConfigError, DSparkConfig, Qwen3Config, get_preset)


def test_presets_have_the_published_dimensions():
    pair = get_preset("qwen3-8b-dspark-block7")
    t, d = pair.target, pair.draft
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.intermediate_size, t.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert (d.num_hidden_layers, d.block_size, d.mask_token_id, d.target_layer_ids, d.markov_rank) == \
        (5, 7, 151669, [1, 9, 17, 25, 33], 256)
    tiny = get_preset("qwen3-tiny-dspark")
    assert tiny.target.hidden_size == 64 and tiny.target.vocab_size == 512
    assert tiny.draft.target_layer_ids[-1] < tiny.target.num_hidden_layers - 1


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*qwen3-tiny-dspark"):
        get_preset("nope")


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("hidden_size", 0, "hidden_size"),
    ("head_dim", 7, "head_dim"),
    ("rope_theta", -1.0, "rope_theta"),
])
def test_bad_target_config_names_the_field(field, value, match):
    cfg = dataclasses.replace(get_preset("qwen3-tiny-dspark").target, **{field: value})
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


@pytest.mark.parametrize("ids,match", [
    ([0, 3], "last target layer"),          # 3 is the last layer of the 4-layer tiny target
    ([0, 7], "last target layer"),          # out of range
    ([2, 1], "strictly increasing"),
    ([-1, 2], "negative"),
    ([], "at least one"),
])
def test_bad_target_layer_ids(ids, match):
    pair = get_preset("qwen3-tiny-dspark")
    pair.draft.target_layer_ids = ids
    with pytest.raises(ConfigError, match="target_layer_ids.*" + match):
        pair.validate()


def test_draft_target_mismatch_and_mask_token():
    pair = get_preset("qwen3-tiny-dspark")
    pair.draft.num_target_layers = 5
    with pytest.raises(ConfigError, match="num_target_layers"):
        pair.validate()
    pair = get_preset("qwen3-tiny-dspark")
    pair.draft.mask_token_id = 512
    with pytest.raises(ConfigError, match="mask_token_id"):
        pair.validate()


def test_hf_round_trip_and_both_rope_spellings():
    pair = get_preset("qwen3-8b-dspark-block7")
    t = Qwen3Config.from_hf(pair.target.to_hf())
    assert t == pair.target
    d = DSparkConfig.from_hf(pair.draft.to_hf())
    assert d == pair.draft
    hf = pair.target.to_hf()
    theta = hf.pop("rope_theta")
    hf["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    assert Qwen3Config.from_hf(hf).rope_theta == theta
    hf.pop("hidden_size")
    with pytest.raises(ConfigError, match="'hidden_size': missing"):
        Qwen3Config.from_hf(hf)


def test_dflash_style_nested_config():
    hf = get_preset("qwen3-tiny-dspark").draft.to_hf()
    ids, mask = hf.pop("target_layer_ids"), hf.pop("mask_token_id")
    hf["dflash_config"] = {"target_layer_ids": ids, "mask_token_id": mask}
    hf.pop("markov_rank")
    d = DSparkConfig.from_hf(hf)
    assert d.target_layer_ids == ids and d.mask_token_id == mask and d.markov_rank == 0


def test_model_source_is_the_one_list_of_model_options():
    """Every ModelSource field has exactly one CLI flag; BuildOptions and serving's ServedModel
    extend it (the CLI, builder, serving and LLM.from_source read the same fields)."""
    import argparse
    from dataclasses import fields

    from dspark_trt.builder.build import BuildOptions
    from dspark_trt.config.source import FLAGS, ModelSource, add_source_args
    from dspark_trt.serving.source import ServedModel
    names = [f.name for f in fields(ModelSource)]
    assert list(FLAGS) == names
    assert issubclass(BuildOptions, ModelSource) and issubclass(ServedModel, ModelSource)
    p = argparse.ArgumentParser()
    add_source_args(p)
    args = p.parse_args(["--model", "m", "--dtype", "bf16", "--tp-size", "2", "--max-seq-len", "64"])
    assert ModelSource.from_args(args) == ModelSource(model="m", dtype="bf16", tp_size=2, max_seq_len=64)
