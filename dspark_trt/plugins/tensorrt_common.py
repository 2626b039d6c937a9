"""What the ops' TensorRT descriptors (``<op package>/tensorrt.py``) share. Needs TensorRT."""
from __future__ import annotations

from typing import Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .aot import compile_ptx

NS = "dspark"
_TORCH = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16}
_FLOAT = "FP32|FP16|BF16"
AotResult = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]


def _ptx(name: str, dtype, **constants):
    kname, ptx, md = compile_ptx(name, _TORCH[dtype], **constants)
    lp = trtp.KernelLaunchParams()
    lp.block_x = md.num_warps * 32
    lp.shared_mem = md.shared
    return kname.encode(), ptx.encode(), lp
