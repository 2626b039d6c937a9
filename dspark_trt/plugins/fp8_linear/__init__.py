"""dspark::fp8_linear — ``x @ W^T`` with W held in fp8 e4m3 and one fp32 scale per 128x128 block.

Layout of the Qwen3-FP8 / DeepSeek checkpoints: ``weight [N, K] float8_e4m3fn`` and
``weight_scale_inv [ceil(N/128), ceil(K/128)]`` (fp32; bf16 in some checkpoints, converted at load),
``W_real[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (the name says "inverse"
because the quantiser divided by it). No bias.

Reference: dequantise W to ``x.dtype`` (fp32 multiply, one rounding), then ``F.linear``: exactly
what a bf16-dequantised checkpoint computes. Kernel (``kernels/fp8_gemm.py``): streams the fp8
tiles (half the bytes of bf16), takes fp8 -> x.dtype (exact) products with fp32 accumulation per
128-wide K block and multiplies each block's partial sum by its scale: the same value up to the
rounding of the dequantised weight (kernel: exact, reference: rounded to ``x.dtype``) and the
summation order.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dispatch import use_triton
from ..opspec import OpSpec

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_AMAX_MIN = 1e-10          # W8A8: the least group amax (an all-zero group gets codes 0, no inf / NaN)


def scale_shape(N: int, K: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return -(-N // block), -(-K // block)


def check_fp8_args(x: Tensor, weight: Tensor, scale: Tensor) -> None:
    """Raise ValueError naming the argument that does not fit."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"dspark::fp8_linear: weight must be 2-D float8_e4m3fn, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"dspark::fp8_linear: x has {x.shape[-1]} features, weight [N={N}, K={K}] wants K")
    if tuple(scale.shape) != scale_shape(N, K) or scale.dtype != torch.float32:
        raise ValueError(f"dspark::fp8_linear: weight_scale_inv is {scale.dtype} {tuple(scale.shape)}, "
                         f"expected float32 {scale_shape(N, K)} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block)")


def dequantize_fp8(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[N, K] fp8, [ceil(N/128), ceil(K/128)] fp32 -> [N, K] in ``dtype`` (fp32 product, one rounding)."""
    N, K = weight.shape
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
    return (weight.float() * s).to(dtype)


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (fp8 e4m3 [N, K], fp32 scale [ceil(N/128), ceil(K/128)]), scale = amax / 448
    per block (all-zero blocks: 1), as the published FP8 checkpoints are made."""
    N, K = w.shape
    R, C = scale_shape(N, K)
    padded = w.new_zeros(R * FP8_BLOCK, C * FP8_BLOCK, dtype=torch.float32)
    padded[:N, :K] = w.float()
    amax = padded.view(R, FP8_BLOCK, C, FP8_BLOCK).abs().amax((1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_activation_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (fp8 e4m3 codes [..., K], fp32 scales [..., ceil(K/128)]) per token and
    128-column group (DeepSeek's ``act_quant``, vLLM's per-token-group fp8 quantisation): with
    a = max(amax, ACT_AMAX_MIN), code = x * (448 / a) rounded to nearest, scale = a / 448 (fp32;
    the kernels compute the same two divisions per group and one multiply per value)."""
    K = x.shape[-1]
    G = -(-K // FP8_BLOCK)
    xf = F.pad(x.float(), (0, G * FP8_BLOCK - K)).unflatten(-1, (G, FP8_BLOCK))
    amax = xf.abs().amax(-1).clamp_min(ACT_AMAX_MIN)
    scale = amax / FP8_MAX
    inv = torch.full_like(amax, FP8_MAX) / amax         # IEEE division (scalar / tensor is 1 / t times the scalar)
    q = (xf * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :K].contiguous(), scale


def quantize_activations_fp8(x: Tensor) -> Tensor:
    """x [..., K] -> its W8A8 value in fp32 (``quantize_activation_groups``' codes times their scales)."""
    q, scale = quantize_activation_groups(x)
    K = x.shape[-1]
    return q.float() * scale.repeat_interleave(FP8_BLOCK, -1)[..., :K]


def fp8_linear_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bucket: int = 0,
                   act_quant: bool = False) -> Tensor:
    """x [..., K], weight [N, K] fp8, weight_scale_inv [ceil(N/128), ceil(K/128)] f32 -> [..., N].
    ``bucket``: the kernel's launch choice (``fp8_linear``), no effect on the value. ``act_quant``
    (W8A8): x quantised per (token, 128-column group) to fp8 first (``quantize_activations_fp8``),
    the product of the two dequantised operands taken in fp32."""
    if act_quant:
        return F.linear(quantize_activations_fp8(x), dequantize_fp8(weight, weight_scale_inv, torch.float32)).to(x.dtype)
    return F.linear(x, dequantize_fp8(weight, weight_scale_inv, x.dtype))


@torch.library.triton_op("dspark::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bucket: int = 0,
               act_quant: bool = False) -> Tensor:
    """``bucket`` (kernel only): 0 picks the launch from x's token count (one launch for any count
    when it is symbolic); 1, 16, 32, 64, 128 take that bucket's launch (``kernels.fp8_gemm.bucket_config``)
    whatever the count: ``fp8_linear_bucketed`` passes the bucket its ``torch.cond`` chose.
    ``act_quant``: W8A8 (``fp8_linear_ref``; the kernel quantises x once per call, or per tile in
    its 1-2-token body, and runs fp8 x fp8 tensor-core dots)."""
    check_fp8_args(x, weight, weight_scale_inv)
    if use_triton(x):
        from ..kernels.fp8_gemm import fp8_gemm
        K, N = weight.shape[1], weight.shape[0]
        return fp8_gemm(x.reshape(-1, K), weight, weight_scale_inv, bucket=bucket,
                        act_quant=act_quant).view(*x.shape[:-1], N)
    return fp8_linear_ref(x, weight, weight_scale_inv, act_quant=act_quant)


# dynamo's note on a torch.cond whose predicate is a Python constant (a count it specialised, e.g. 1):
# that branch is the one wanted
warnings.filterwarnings("ignore", message="Pred is a Python constant", category=UserWarning)

TOKEN_BUCKETS = (1, 16, 32, 64)  # symbolic token counts: the first bucket >= the count, else LARGE_BUCKET
LARGE_BUCKET = 128


def token_count(x: Tensor):
    """Rows of x [..., K]: an int, or a SymInt when x's leading dims are symbolic."""
    n = 1
    for d in x.shape[:-1]:
        n = n * d
    return n


def fp8_linear_bucketed(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, host_choice: bool | None = None,
                        act_quant: bool = False) -> Tensor:
    """``dspark::fp8_linear`` as the models call it. A concrete token count (eager calls, CUDA-graph
    captures) picks its launch inside the op. A symbolic one (an engine's dynamic tokens) and any
    count under ``torch.compile`` on a GPU is bucketed on the host: nested ``torch.cond`` on the
    count (M <= 1, 16, 32, 64, else) call the op with that bucket, so each branch compiles one kernel
    body with its own tiles, where the op alone would compile every body into one launch.
    ``host_choice``: force (True) or skip (False) the buckets; None: as just said. ``act_quant``:
    W8A8 (``fp8_linear``).

    Named ``dspark::fp8_linear`` to torch-function modes (``_qualified_op_name``, below): the
    builder's ``ReferenceOps`` sees this call as the op (to inline or to keep), which it could not
    inside ``torch.cond``'s branches."""
    if host_choice is None:
        if torch.overrides.has_torch_function_variadic(x, weight, weight_scale_inv):
            return torch.overrides.handle_torch_function(fp8_linear_bucketed, (x, weight, weight_scale_inv),
                                                         x, weight, weight_scale_inv, act_quant=act_quant)
        # dynamo shows a symbolic size to isinstance as an int, so under torch.compile every count
        # takes the buckets (a concrete one specialises each torch.cond to its branch); without this
        # the compiled W8A8 step ran one 64-token-tile launch for 8 tokens, 2-2.7x the bucket's time
        # (fp8-compiled-probe-NVIDIA-H200-bd900e5.json)
        host_choice = use_triton(x) and (torch.compiler.is_dynamo_compiling()
                                         or isinstance(token_count(x), torch.SymInt))
    if not host_choice:
        return torch.ops.dspark.fp8_linear(x, weight, weight_scale_inv, 0, act_quant)
    return _from_bucket(0, weight, weight_scale_inv, act_quant)(x)


fp8_linear_bucketed._qualified_op_name = "dspark::fp8_linear"


def _from_bucket(i: int, w: Tensor, s: Tensor, act_quant: bool):
    """The branch for token counts above ``TOKEN_BUCKETS[i - 1]``. The weights are closed over, not
    operands: ``torch.cond`` would trace operands with symbolic sizes."""
    if i == len(TOKEN_BUCKETS):
        return lambda x: torch.ops.dspark.fp8_linear(x, w, s, LARGE_BUCKET, act_quant)
    bucket = TOKEN_BUCKETS[i]

    def branch(x: Tensor) -> Tensor:
        return torch.cond(token_count(x) <= bucket, lambda x: torch.ops.dspark.fp8_linear(x, w, s, bucket, act_quant),
                          _from_bucket(i + 1, w, s, act_quant), (x,))
    return branch


OPS = (
    OpSpec("fp8_linear", fp8_linear_ref, triton="kernels.fp8_gemm:fp8_gemm", export_safe=True),
)
