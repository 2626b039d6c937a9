"""Load an engine's compiled networks: AOTInductor packages (weights bound from the engine's
safetensors file) and TensorRT plans, both called as ``net(*inputs, caches)``."""
from __future__ import annotations

from pathlib import Path

import torch

from .manifest import EngineError


def import_tensorrt(error: type[Exception]):
    """``tensorrt`` with the dspark plugin descriptors registered; ``error`` when it is not importable."""
    try:
        import tensorrt as trt
    except Exception as e:
        raise error(f"TensorRT is not importable ({e}); use --backend aoti") from e
    try:                                            # plugin descriptors, when the plugins ship them
        import dspark_trt.plugins.tensorrt_plugins  # noqa: F401
    except ImportError:
        pass
    return trt


def load_aoti_network(path: Path, device: torch.device, constants: dict[str, torch.Tensor]):
    """Load a package and bind its weights (no copy). Raises if a weight is missing or extra."""
    from torch._inductor import aoti_load_package
    model = aoti_load_package(str(path), run_single_threaded=device.type == "cuda")
    fqns = model.get_constant_fqns()
    missing = [n for n in fqns if n not in constants]
    if missing:
        raise EngineError(f"{path.name}: weights missing for constant(s) {missing[:3]}")
    model.load_constants({n: constants[n] for n in fqns}, check_full_update=True, user_managed=True)
    return model


class TensorRTNetwork:
    """Runs one plan with the same call convention as an AOTI package: ``net(*inputs, caches)``."""

    def __init__(self, plan_path: Path, device: torch.device, outputs: list[str], input_names: list[str]):
        trt = import_tensorrt(EngineError)
        self.trt, self.device = trt, device
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise EngineError(f"{plan_path}: TensorRT cannot deserialize the plan (rebuild the engine)")
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
