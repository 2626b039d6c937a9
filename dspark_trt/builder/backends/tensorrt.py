"""TensorRT backend: ONNX (dspark nodes = plugins) -> serialized plan with one optimisation profile.

``tensorrt`` is imported lazily: ONNX export and profile computation run without it. Plans are
strongly typed (precision from the ONNX tensor types, TensorRT 10 flag / always on in 11). The
dspark plugin definitions (``dspark_trt.plugins.tensorrt_plugins``: ``@trtp.register`` +
``@trtp.aot_impl``) are imported before parsing so the parser maps ``dspark::<op>`` nodes to them.
KV caches are inputs ``cache.<i>``; each cache the network writes is also an output
``present.<i>``, which the runtime (``engine.networks.TensorRTNetwork``) binds to the same device
address (in-place update).
"""
from __future__ import annotations

from pathlib import Path

from ...engine.networks import import_tensorrt
from . import BuildError

WORKSPACE_BYTES = 8 << 30


def _trt():
    return import_tensorrt(BuildError)


def profile_shapes(spec, shapes) -> dict[str, tuple[tuple[int, ...], ...]]:
    """{input name: (min, opt, max)} from the spec's dynamic dims and the build ranges."""
    from torch.export.dynamic_shapes import _DerivedDim
    opt_pages = shapes.num_pages()

    def bounds(dim, size):
        if dim is None:
            return size, size, size
        if isinstance(dim, _DerivedDim):          # num_pages * c + b (caches)
            lo, hi = dim.root.min, opt_pages
            f = dim.fn
            return f(lo), f(opt_pages), f(hi)
        if dim.__name__ == "num_pages":
            return 1, opt_pages, opt_pages
        opt = {"batch": shapes.max_batch_size, "tokens": shapes.num_spec_tokens + 1}.get(dim.__name__, dim.max)
        return dim.min, min(opt, dim.max), dim.max

    names = spec.input_names + [f"cache.{i}" for i in range(len(spec.args[-1]))]
    dyns = list(spec.dynamic_shapes.values())
    dyns = dyns[:-1] + list(dyns[-1])
    tensors = list(spec.args[:-1]) + list(spec.args[-1])
    out = {}
    for name, t, dyn in zip(names, tensors, dyns):
        per_dim = [bounds((dyn or {}).get(i), s) for i, s in enumerate(t.shape)]
        out[name] = tuple(tuple(d[k] for d in per_dim) for k in range(3))
    return out


def build_plan(onnx_path: Path, profile: dict, plan_path: Path) -> None:
    """Parse the ONNX file and serialize a plan for the profile ranges (needs a GPU)."""
    trt = _trt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    prof = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        prof.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(prof)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT failed to build a plan for {onnx_path.name} (see the log above)")
    plan_path.write_bytes(bytes(plan))
