"""Shared Triton helpers: the counter-based hash RNG of ``..rng`` on ``tl.uint32`` and launch glue.

``mix32``/``row_key``/``uniform``/``gumbel`` reproduce ``dspark_trt.plugins.rng`` bit for bit for
the hash and the uniforms (uint32 arithmetic wraps exactly like the reference's ``& 0xFFFFFFFF``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import rng

try:                                          # Triton >= 3.3 on NVIDIA; absent: no PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                           # pragma: no cover - depends on the Triton build
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GOLDEN = tl.constexpr(rng.GOLDEN)
C1 = tl.constexpr(rng.C1)
C2 = tl.constexpr(rng.C2)
STREAM_DRAFT = tl.constexpr(rng.STREAM_DRAFT)
STREAM_ACCEPT = tl.constexpr(rng.STREAM_ACCEPT)
STREAM_RESIDUAL = tl.constexpr(rng.STREAM_RESIDUAL)
# Expert weight formats of the MoE kernels (moe.py, moe_decode.py): bf16 / fp32 values, or MXFP4
# (packed E2M1 nibbles + one E8M0 scale per 32 columns).
DENSE = tl.constexpr(0)
MXFP4 = tl.constexpr(1)


@triton.jit
def mix32(x):
    """murmur3 fmix32 on uint32."""
    x = x ^ (x >> 16)
    x = x * tl.full([], C1, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([], C2, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def row_key(seed, position, STREAM: tl.constexpr):
    """int64 seed, int64 position (scalars or tensors) -> uint32 key (``rng.row_key``)."""
    lo = seed.to(tl.int64).to(tl.uint32)                  # truncation = & 0xFFFFFFFF
    hi = (seed.to(tl.int64) >> 32).to(tl.uint32)
    salt = tl.full([], (STREAM * C1) & 0xFFFFFFFF, tl.uint32)
    k = mix32(lo + hi * tl.full([], GOLDEN, tl.uint32) + salt)
    return mix32(k ^ position.to(tl.int64).to(tl.uint32))


@triton.jit
def uniform(key, idx):
    """uint32 key, int vocabulary index -> float32 uniform in (0, 1) (``rng.uniform``)."""
    h = mix32(key ^ (idx.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32)))
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def gumbel(key, idx):
    return -tl.log(-tl.log(uniform(key, idx)))


@triton.jit
def round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32 (finite inputs): the GPU's
    conversion, also under the interpreter, whose fp32 -> bf16 conversion truncates."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def swiglu_bf16(xp, K, offs):
    """``bf16(bf16(silu(gate)) * up)`` at columns ``offs`` of a fused row ``[gate | up]`` (K each) at
    xp, as fp32: the roundings of ``F.silu(gate) * up``."""
    gate = tl.load(xp + offs).to(tl.float32)
    act = round_bf16(gate / (1.0 + tl.exp(-gate)))
    return round_bf16(act * tl.load(xp + K + offs).to(tl.float32))


@triton.jit
def residual_sum(xp, rp, rop, offs, K, pid, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr):
    """``h = bf16(x + residual)`` at columns ``offs`` (x alone without HAS_RES), as fp32; with
    STORE_RES the program / N tile ``pid`` 0 writes it to the residual output at rop."""
    h = tl.load(xp + offs).to(tl.float32)
    if HAS_RES:
        h = round_bf16(h + tl.load(rp + offs).to(tl.float32))
        if STORE_RES:
            tl.store(rop + offs, h.to(tl.bfloat16), mask=offs < K - tl.minimum(pid, 1) * K)    # pid 0 only
    return h


@triton.jit
def col_scale(scale, nb, stride_sn, cols, SCALED: tl.constexpr):
    """The fp32 block scales ``scale[nb, cols // 128]`` of fp8 weight columns ``cols`` (any shape) in
    the row of 128 x 128 scale blocks ``nb`` (row stride ``stride_sn``), to multiply the activations
    those columns meet; 1.0 (nothing loaded) where not SCALED."""
    if SCALED:
        s = tl.load(scale + nb * stride_sn + cols // 128)
    else:
        s = 1.0
    return s


def launcher(kernel):
    """``kernel[grid]`` as torch.compile / export should see it (``wrap_triton``), or the plain
    kernel under the interpreter, where tensors live on the CPU."""
    if INTERPRET:
        return kernel
    return torch.library.wrap_triton(kernel)


# Ticket reductions (one launch: the last program of a tile merges the partials) count arrivals in
# cached int32 counters that every kernel leaves at zero. Kernels on one stream run one after the
# other, so every ticket kernel of a device shares one buffer.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def tracing() -> bool:
    """Whether this call is traced (torch.compile / export: fake tensors), where the ticket
    reduction's cached counters would hold a fake tensor: such calls reduce in two passes."""
    from torch._guards import detect_fake_mode
    return torch.compiler.is_compiling() or detect_fake_mode() is not None


def ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """Cached zeroed int32 counters (the kernels leave them at zero); grown on demand. Outgrown
    buffers are kept alive: a CUDA graph captured earlier may still point at them."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for anything else: interpreter tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# resident blocks per SM where the CUDA occupancy table says fewer than 32 (compute capability)
MAX_BLOCKS_PER_SM = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}


def max_resident_programs(compiled, device: torch.device, props=None) -> int:
    """Programs of a compiled Triton kernel one SM holds at once: the least of its register, warp,
    shared-memory and block limits (registers allocated per warp in units of 256)."""
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()                 # fills n_regs
    props = props or torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    blocks = MAX_BLOCKS_PER_SM.get((getattr(props, "major", 9), getattr(props, "minor", 0)), 32)
    fit = min(blocks, getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
              getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps))
    shared = compiled.metadata.shared
    if shared:
        fit = min(fit, getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024))
    return fit


def row_slices(rows: int, V: int, block: int, per_sm: int, device: torch.device,
               slices: int | None = None) -> tuple[int, int]:
    """How a grid (rows, S) splits each row of V columns: (S, chunk), chunk a multiple of ``block``
    and S = cdiv(V, chunk). ``slices`` (None: about ``per_sm`` programs per SM in all, each at least
    one ``block``) is the request; S can come out smaller (whole blocks per slice)."""
    S = slices or max(1, min(triton.cdiv(V, block), triton.cdiv(per_sm * num_sms(device), max(rows, 1))))
    chunk = triton.cdiv(triton.cdiv(V, S), block) * block
    return triton.cdiv(V, chunk), chunk


def pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with programmatic dependent launch: a CUDA GPU of
    sm_90+ (not the interpreter) and a Triton that has ``gdc_wait``."""
    device = torch.device(device)
    return (device.type == "cuda" and not INTERPRET and gdc_wait is not None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_launch(pdl: bool, where: str, x: torch.Tensor) -> dict:
    """Launch options of a kernel with programmatic dependent launch (``pdl``: its ``PDL``
    constexpr calls ``gdc_launch_dependents`` / ``gdc_wait``): ``launch_pdl`` on a CUDA GPU
    (sm_90+) with a Triton that has them; else a clear error naming ``where``."""
    if not pdl:
        return {}
    if gdc_wait is None or INTERPRET or not x.is_cuda:
        raise ValueError(f"{where}: pdl=True needs a CUDA GPU (sm_90+) and a Triton with gdc_wait")
    return {"launch_pdl": True}
