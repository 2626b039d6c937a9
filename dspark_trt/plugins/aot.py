"""Ahead-of-time PTX of the dspark kernels, for TensorRT AOT plugins (and any cubin launcher).

TensorRT's AOT plugin launcher passes ``(input pointers..., int32 scalars..., output pointers...)``
(platform notes §3), so each op has an entry kernel in that order, ``<op package>/aot.py:<name>_aot``,
that calls the op's Triton kernel; float attributes (``scale``) and tile sizes are compile-time constants. Triton appends a
global-scratch and a profile-scratch pointer to every kernel; that is harmless only when neither
is used, so ``compile_ptx`` asserts both sizes are 0.

``compile_ptx(name, dtype=torch.bfloat16, **constants)`` compiles for ``GPUTarget("cuda", 90, 32)``
with ``ptx_version=90`` (PTX ISA 9.0: the H200's 580 driver rejects newer) on any machine,
CPU-only included, and returns ``(kernel_name, ptx, metadata)``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget

from .registry import OPS

TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = {"ptx_version": 90, "enable_fp_fusion": False}


_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8"}


@dataclass(frozen=True)
class AotKernel:
    fn: object
    pointers: tuple[str, ...]        # pointer args: "T" (the op's float dtype) or a fixed dtype key
    ints: tuple[str, ...]
    constants: dict                  # default compile-time constants
    num_warps: int = 4
    num_stages: int = 3


def _entry(op) -> AotKernel:
    fn = getattr(importlib.import_module(f"{op.package}.aot"), f"{op.name}_aot")
    constants = op.aot.constants() if callable(op.aot.constants) else dict(op.aot.constants)
    return AotKernel(fn, op.aot.pointers, op.aot.ints, constants, op.aot.num_warps, op.aot.num_stages)


# op name -> its AOT entry kernel (``<op package>/aot.py:<name>_aot``), signature from the op registry
AOT_KERNELS = {name: _entry(op) for name, op in OPS.items() if op.aot is not None}
# output pointer dtypes, after the int scalars
_OUTPUTS = {name: op.aot.outputs for name, op in OPS.items() if op.aot is not None}


def compile_ptx(name: str, dtype: torch.dtype = torch.bfloat16, **constants):
    """Compile the AOT entry kernel of op ``name`` -> (kernel_name, ptx, metadata)."""
    spec = AOT_KERNELS[name]
    consts = {**spec.constants, **constants}
    unknown = set(constants) - set(spec.constants)
    if unknown:
        raise ValueError(f"{name}: unknown compile-time constants {sorted(unknown)}")
    ptrs = spec.pointers + _OUTPUTS[name]
    ptr_args = [a for a in spec.fn.arg_names if a not in spec.ints and a not in consts]
    if len(ptr_args) != len(ptrs):
        raise AssertionError(f"{name}: {len(ptr_args)} pointer args vs {len(ptrs)} dtypes")
    sig = {a: _PTR[dtype if t == "T" else t] for a, t in zip(ptr_args, ptrs)}
    sig.update({a: "i32" for a in spec.ints})
    sig.update({a: "constexpr" for a in consts})
    sig = {a: sig[a] for a in spec.fn.arg_names}
    # TensorRT hands plugins whole tensors from its allocator (256-byte aligned): telling Triton the
    # pointers are 16-byte aligned lets it vectorise and pipeline loads (else: 2-byte loads)
    aligned = {(spec.fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ptr_args}
    src = triton.compiler.ASTSource(fn=spec.fn, signature=sig, constexprs=consts, attrs=aligned)
    k = triton.compile(src, target=TARGET, options={**OPTIONS, "num_warps": spec.num_warps,
                                                      "num_stages": spec.num_stages})
    md = k.metadata
    if md.global_scratch_size != 0 or md.profile_scratch_size != 0:
        raise RuntimeError(f"{name}: kernel needs scratch memory (global {md.global_scratch_size}, "
                           f"profile {md.profile_scratch_size}); a TensorRT AOT plugin cannot pass it")
    return md.name, k.asm["ptx"], md
