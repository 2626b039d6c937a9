"""AOT PTX of every TensorRT entry kernel (compiled on CPU for sm_90) and the TensorRT import guard."""
from __future__ import annotations

import importlib
import importlib.util
import re

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

from dspark_trt.plugins.aot import AOT_KERNELS, compile_ptx  # noqa: E402

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def compiled():
    try:
        return {name: compile_ptx(name) for name in AOT_KERNELS}
    except RuntimeError as e:           # e.g. a Triton without the CUDA backend's ptxas
        if "scratch" in str(e):
            raise
        pytest.skip(f"Triton cannot compile for cuda sm_90 on this machine: {e}")


@pytest.mark.parametrize("name", sorted(AOT_KERNELS))
def test_ptx_targets_the_h200_driver(compiled, name):
    kname, ptx, md = compiled[name]
    major, minor = map(int, re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M).groups())
    assert (major, minor) <= (9, 0)                     # driver 580 (CUDA 13.0) accepts up to PTX 9.0
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    assert md.global_scratch_size == 0 and md.profile_scratch_size == 0
    # TensorRT passes (inputs, int32 scalars, outputs); Triton appends two scratch pointers
    spec = AOT_KERNELS[name]
    n_args = len([a for a in spec.fn.arg_names if a not in spec.constants])
    entry = re.search(rf"\.entry {kname}\((.*?)\)", ptx, re.S).group(1)
    assert entry.count(".param") == n_args + 2


@pytest.mark.parametrize("name", sorted(AOT_KERNELS))
def test_aot_kernels_fit_sm90_shared_memory(compiled, name):
    """A TensorRT enqueue cannot fall back to a smaller tile: each entry kernel's shared memory must
    fit sm_90's 227 KiB per block (e.g. 3 stages of sparse MLA's 64-entry tiles need more)."""
    assert compiled[name][2].shared <= 227 * 1024


def test_sparse_mla_aot_takes_the_export_tile():
    """TensorRT's batch is dynamic: its entry kernel runs the tile an AOTI export takes for a
    symbolic token count (``mla_config``), not constants of its own."""
    import torch
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dspark_trt.plugins.kernels import sparse_mla as ksm
    spec = AOT_KERNELS["sparse_mla_attention"]
    T = ShapeEnv().create_unbacked_symint()
    cfg = ksm.mla_config(T, 128, 512, 512, 512, torch.device("cpu"))
    assert cfg["num_splits"] == 1 and cfg["block_dv"] == spec.constants["DV"]
    assert (spec.constants["BLOCK_H"], spec.constants["BLOCK_N"], spec.constants["BLOCK_SCAN"]) == \
        (cfg["block_h"], cfg["block_n"], cfg["scan"])
    assert spec.constants["PREFETCH"] == cfg["prefetch"]
    assert (spec.num_warps, spec.num_stages) == (cfg["num_warps"], cfg["num_stages"])


def test_aot_kernels_use_wide_loads(compiled):
    """Pointer arguments are declared 16-byte aligned: the attention entry loads K/V with vector /
    cp.async loads, not one bf16 at a time (it made 160 two-byte loads without the hint)."""
    ptx = compiled["block_attention"][1]
    assert not re.search(r"ld\.global[^\n]*\.b16", ptx)
    assert re.search(r"cp\.async|ld\.global[^\n]*\.v[24]", ptx)


def test_compile_ptx_rejects_unknown_constants():
    with pytest.raises(ValueError, match="BLOCKZ"):
        compile_ptx("kv_cache_write", BLOCKZ=3)


def test_tensorrt_module_is_guarded():
    if HAVE_TRT:
        pytest.skip("tensorrt is installed: the guard does not apply")
    with pytest.raises(ImportError):
        importlib.import_module("dspark_trt.plugins.tensorrt_plugins")


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAVE_TRT, reason="tensorrt is not installed (needs pypi.nvidia.com or an NGC image)")
def test_tensorrt_plugins_register():
    import tensorrt.plugin as trtp
    mod = importlib.import_module("dspark_trt.plugins.tensorrt_plugins")
    for name in mod.PLUGINS:
        assert hasattr(trtp.op.dspark, name)
