"""Exported networks (V4 and Qwen3) carry no lifted tensor constants: every tensor they read is a parameter or
buffer that moves with the module. A plain host tensor (the old float64 RoPE frequencies) becomes
a host constant inside a CUDA engine; AOTInductor then copies it to the device under a name no
weight provides (``_tensor_constant0``), and the engine cannot load."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.builder.build import BuildOptions, load_models
from dspark_trt.builder.export import BuildShapes, export_network, network_specs, reference_impls


@pytest.mark.parametrize("model", ["deepseek-v4-tiny-dspark", "qwen3-tiny-dspark"])
def test_networks_export_without_tensor_constants(model):
    o = BuildOptions(model=model, random_weights=True, dtype="fp32", device="cpu",
                     output="unused").resolved()
    _, target, draft = load_models(o, torch.float32, torch.device("cpu"))
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, draft.config.block_size, o.page_size)
    for spec in network_specs(target, draft, shapes, torch.float32, torch.device("cpu")):
        ep, _ = export_network(spec, set(reference_impls()))
        assert not ep.constants, f"{spec.name}: lifted tensor constants {sorted(ep.constants)[:3]}"
