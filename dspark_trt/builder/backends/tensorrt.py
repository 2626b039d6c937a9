"""TensorRT backend: ONNX (dspark nodes = plugins) -> serialized plan with one optimisation profile.

``tensorrt`` is imported lazily: ONNX export and profile computation run without it. Plans are
strongly typed (precision from the ONNX tensor types, TensorRT 10 flag / always on in 11). The
dspark plugin definitions (``dspark_trt.plugins.tensorrt_plugins``: ``@trtp.register`` +
``@trtp.aot_impl``) are imported before parsing so the parser maps ``dspark::<op>`` nodes to them.
KV caches are inputs ``cache.<i>``; each cache the network writes is also an output
``present.<i>``, which the runtime binds to the same device address (in-place update).
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import BuildError

WORKSPACE_BYTES = 8 << 30


def _trt():
    try:
        import tensorrt as trt
    except Exception as e:
        raise BuildError(f"TensorRT is not importable ({e}); use --backend aoti") from e
    try:                                            # plugin descriptors, when the plugins ship them
        import dspark_trt.plugins.tensorrt_plugins  # noqa: F401
    except ImportError:
        pass
    return trt


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


class TensorRTNetwork:
    """Runs one plan with the same call convention as an AOTI package: ``net(*inputs, caches)``."""

    def __init__(self, plan_path: Path, device: torch.device, outputs: list[str], input_names: list[str]):
        trt = _trt()
        self.trt, self.device = trt, device
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise BuildError(f"{plan_path}: TensorRT cannot deserialize the plan (rebuild the engine)")
        self.context = self.engine.create_execution_context()
        self.input_names, self.outputs = input_names, outputs

    def __call__(self, *args):
        *inputs, caches = args
        ctx, stream = self.context, torch.cuda.current_stream(self.device)
        for name, t in [*zip(self.input_names, inputs), *((f"cache.{i}", c) for i, c in enumerate(caches))]:
            t = t.contiguous()
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        results = []
        for name in self.outputs:
            if name.startswith("present."):                 # in place: alias the cache input
                ctx.set_tensor_address(name, caches[int(name.split(".")[1])].data_ptr())
                continue
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = _torch_dtype(self.trt, self.engine.get_tensor_dtype(name))
            out = torch.empty(shape, dtype=dtype, device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            results.append(out)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        return tuple(results)


def _torch_dtype(trt, dt):
    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}[dt]
