"""Ahead-of-time PTX of the dspark kernels, for TensorRT AOT plugins (and any cubin launcher).

TensorRT's AOT plugin launcher passes ``(input pointers..., int32 scalars..., output pointers...)``
(platform notes §3), so each op has an entry kernel here in that order that calls the op's Triton
kernel; float attributes (``scale``) and tile sizes are compile-time constants. Triton appends a
global-scratch and a profile-scratch pointer to every kernel; that is harmless only when neither
is used, so ``compile_ptx`` asserts both sizes are 0.

``compile_ptx(name, dtype=torch.bfloat16, **constants)`` compiles for ``GPUTarget("cuda", 90, 32)``
with ``ptx_version=90`` (PTX ISA 9.0: the H200's 580 driver rejects newer) on any machine,
CPU-only included, and returns ``(kernel_name, ptx, metadata)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .kernels.block_attention import block_attention_kernel
from .kernels.kv_cache import kv_cache_write_kernel
from .kernels.markov import markov_rows_kernel
from .kernels.moe import moe_experts_token_kernel
from .kernels.rejection import rejection_sample_kernel
from .kernels.sparse_mla import sparse_mla_attention_kernel
from .kernels.swa_indices import noncausal_swa_indices_kernel
from .registry import OPS

TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = {"ptx_version": 90, "enable_fp_fusion": False}


@triton.jit
def kv_cache_write_aot(k_cache, v_cache, k, v, block_table, positions, T, P, PAGE_SIZE, ROW,
                       k_cache_out, v_cache_out, BLOCK: tl.constexpr):
    """Outputs alias the cache inputs (in place); grid (B * T,)."""
    kv_cache_write_kernel(k_cache_out, v_cache_out, k, v, block_table, positions, T, P, PAGE_SIZE, ROW,
                          BLOCK)


@triton.jit
def block_attention_aot(q, k_cache, v_cache, block_table, positions, kv_limit, T, P, PAGE_SIZE, PAD_PAGE,
                        out, SCALE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """grid (B, Hkv, cdiv(T, BLOCK_T))."""
    block_attention_kernel(q, k_cache, v_cache, block_table, positions, kv_limit, out, SCALE, T, P,
                           PAGE_SIZE, PAD_PAGE, H, HKV, D, BLOCK_T, BLOCK_N, PREFETCH)


@triton.jit
def markov_sample_aot(U, anchor, w1, w2, temperature, seed, start, B, N, V, R, tokens, z,
                      BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """grid (cdiv(B, BLOCK_B),): ``markov_rows_kernel``, the one-launch schedule that needs no
    zeroed workspace (a TensorRT AOT plugin has none), at the cost of one SM per row group."""
    markov_rows_kernel(U, anchor, w1, w2, temperature, seed, start, z, tokens, B, N, V, R, N * V, V,
                       BLOCK_B, BLOCK_V, BLOCK_R)


@triton.jit
def rejection_sample_aot(target_logits, draft_tokens, draft_logits, temperature, seed, start, N, V,
                         accepted, next_token, BLOCK_V: tl.constexpr):
    """grid (B,)."""
    rejection_sample_kernel(target_logits, draft_tokens, draft_logits, temperature, seed, start,
                            accepted, next_token, N, V, BLOCK_V)


@triton.jit
def noncausal_swa_indices_aot(start, block_table, P, N, PAGE_SIZE, WINDOW, WIDTH, indices, lens,
                              BLOCK: tl.constexpr):
    """grid (B,)."""
    noncausal_swa_indices_kernel(start, block_table, indices, lens, P, N, PAGE_SIZE, WINDOW, WIDTH, BLOCK)


@triton.jit
def sparse_mla_attention_aot(q, kv, indices, attn_sink, W, H, out, SCALE: tl.constexpr,
                             D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    """grid (T, cdiv(H, BLOCK_H))."""
    sparse_mla_attention_kernel(q, kv, indices, attn_sink, out, SCALE, W, H, D, DV, BLOCK_H, BLOCK_N, DV)


@triton.jit
def moe_experts_aot(x, expert_ids, routing_weights, w13, w2, FIRST_EXPERT, E, D, H, K, out,
                    LIMIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """grid (M, cdiv(D, BLOCK_D)): the one-launch token schedule (no workspace in an AOT plugin)."""
    moe_experts_token_kernel(x, expert_ids, routing_weights, w13, w2, out, FIRST_EXPERT, E, D, H, K,
                             LIMIT, BLOCK_D, BLOCK_H, BLOCK_K)


_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.int64: "*i64", torch.int32: "*i32"}


@dataclass(frozen=True)
class AotKernel:
    fn: object
    pointers: tuple[str, ...]        # pointer args: "T" (the op's float dtype) or a fixed dtype key
    ints: tuple[str, ...]
    constants: dict                  # default compile-time constants
    num_warps: int = 4


# op name -> its AOT entry kernel (``<name>_aot`` above) with the signature from the op registry
AOT_KERNELS = {name: AotKernel(globals()[f"{name}_aot"], op.aot.pointers, op.aot.ints,
                               op.aot.constants() if callable(op.aot.constants) else dict(op.aot.constants),
                               op.aot.num_warps)
               for name, op in OPS.items() if op.aot is not None}
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
    k = triton.compile(src, target=TARGET, options={**OPTIONS, "num_warps": spec.num_warps})
    md = k.metadata
    if md.global_scratch_size != 0 or md.profile_scratch_size != 0:
        raise RuntimeError(f"{name}: kernel needs scratch memory (global {md.global_scratch_size}, "
                           f"profile {md.profile_scratch_size}); a TensorRT AOT plugin cannot pass it")
    return md.name, k.asm["ptx"], md
