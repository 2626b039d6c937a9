"""The op registry (dspark_trt/plugins/registry.py) is complete and consistent: every dspark op is
in it, once, and each exporter's per-op table is derived from it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import dspark_trt.plugins as plugins
from dspark_trt.builder import export
from dspark_trt.plugins.registry import OPS, PACKAGES


def _registered_ops() -> set[str]:
    lib = torch._C._dispatch_get_all_op_names() if hasattr(torch._C, "_dispatch_get_all_op_names") else []
    return {n.split("::")[1].split(".")[0] for n in lib if n.startswith("dspark::")}


def test_every_dspark_op_is_in_the_registry():
    ops = _registered_ops()
    if ops:                              # torch exposes the dispatcher's op list
        assert ops == set(OPS)
    for name in OPS:
        assert hasattr(torch.ops.dspark, name)
        assert getattr(plugins, name) is getattr(torch.ops.dspark, name)
    assert set(plugins.__all__) >= set(OPS)


def test_each_op_lives_in_its_package():
    root = Path(plugins.__file__).parent
    for name, op in OPS.items():
        pkg = op.package.rsplit(".", 1)[1]
        assert pkg in PACKAGES and (root / pkg / "__init__.py").is_file()
        assert op.reference.__module__ == op.package
        if op.aot is not None:
            assert (root / pkg / "aot.py").is_file()
        if op.tensorrt:
            assert (root / pkg / "tensorrt.py").is_file()
            assert op.aot is not None, f"{name}: a TensorRT plugin runs the AOT entry kernel"
        if op.functional is not None:
            assert OPS[op.functional].onnx is None     # the twin exports as this op's node


def test_exporter_tables_are_derived():
    assert export.reference_impls() == {f"dspark::{n}": op.reference for n, op in OPS.items()}
    assert export.EXPORT_SAFE_KERNELS == {f"dspark::{n}" for n, op in OPS.items() if op.export_safe}
    for n, op in OPS.items():         # every op is either export-safe or says why not
        assert op.export_safe != bool(op.reference_reason), n
    if importlib.util.find_spec("onnx") is not None:
        from dspark_trt.plugins import onnx_export
        assert set(onnx_export.SPECS) == {n for n, op in OPS.items() if op.onnx is not None}
        assert onnx_export.TORCH_OPS["kv_cache_update"] == "kv_cache_write"


def test_each_spec_names_a_triton_launcher_that_exists():
    """``OpSpec.triton`` ("kernels.<module>:<launcher>") is only read by people: check it resolves
    (a kernel module split or renamed without updating the spec fails here)."""
    named = {name: spec.triton for name, spec in OPS.items() if spec.triton}
    assert "markov_sample" in named and "markov_sample_topk" in named
    for name, where in named.items():
        module, launcher = where.split(":")
        mod = importlib.import_module(f"dspark_trt.plugins.{module}")
        assert callable(getattr(mod, launcher, None)), f"{name}: {where} does not exist"
