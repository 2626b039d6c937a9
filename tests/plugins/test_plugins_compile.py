"""Every Triton launch of the op launchers compiles for the H200 (sm_90), on a CPU-only machine.

The interpreter tests check the kernels' arithmetic but not Triton's GPU code generation (layouts
of 3-D reductions, pointer/branch typing, shared-memory limits). Here each launcher runs on small
CPU tensors with ``launcher`` replaced by a recorder; every recorded launch (kernel, arguments,
constexprs, num_warps/num_stages) is then compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``. Launch configurations are the GPU defaults plus the tuner's
candidates that change code generation.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

from triton.backends.compiler import GPUTarget  # noqa: E402

from dspark_trt.plugins.kernels import block_attention as kba, markov_launch as kmk  # noqa: E402
from dspark_trt.plugins.kernels import moe as kmoe, moe_decode as kmd, rejection as krj, sparse_mla as ksm  # noqa: E402
from dspark_trt.plugins.kernels import decode_gemv as kdg, decode_rows as kdr, fp8_gemm as kfp8, qk_rope_cache as kqr  # noqa: E402,E501
from dspark_trt.plugins.kernels import finite as kfn  # noqa: E402

from tests.support.plugins_cases import (block_attention_inputs, markov_inputs, moe_inputs, moe_mxfp4_inputs,  # noqa: E402
                                         rejection_inputs, sparse_mla_inputs)

TARGET = GPUTarget("cuda", 90, 32)
_PTR = {torch.float8_e4m3fn: "*fp8e4nv", torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
        torch.int32: "*i32", torch.uint8: "*u8", torch.int8: "*i8"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
SM90_MAX_SHARED = 232448                  # bytes of shared memory one H100 / H200 block may use


class _Recorder:
    """Stands in for ``launcher(kernel)[grid]``: records the launch instead of running it."""

    def __init__(self, launches):
        self.launches = launches

    def __call__(self, kernel):
        return _Grid(self.launches, kernel)


class _Grid:
    def __init__(self, launches, kernel):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def record(monkeypatch, module, fn, *args, **kwargs):
    """``module``: the kernel module whose ``launcher`` ``fn`` calls, or a tuple of them."""
    launches = []
    for m in module if isinstance(module, tuple) else (module,):
        monkeypatch.setattr(m, "launcher", _Recorder(launches))
    fn(*args, **kwargs)
    assert launches, f"{fn.__name__} launched nothing"
    return launches


def _sig(value, float_type="fp32"):
    if value is None:                     # passed as a constexpr instead
        return "constexpr"
    if isinstance(value, torch.Tensor):
        return _PTR[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return float_type
    raise TypeError(f"no Triton signature for {type(value)}")


def compile_launch(kernel, args, kwargs, float_type="fp32"):
    names = kernel.arg_names
    consts = {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    sig = {n: _sig(a, float_type) for n, a in zip(names, args)}
    sig.update({k: "constexpr" for k in consts})
    missing = [n for n in names if n not in sig]
    assert not missing, f"{kernel.__name__}: unbound arguments {missing}"
    # like the JIT launcher: 16-aligned pointers and multiples of 16 get tt.divisibility (vector loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args)
             if isinstance(a, torch.Tensor) or (isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0)}
    options = {"ptx_version": 90, **{k: kwargs[k] for k in _OPTIONS if k in kwargs}}
    src = triton.compiler.ASTSource(fn=kernel, signature={n: sig[n] for n in names}, constexprs=consts,
                                    attrs=attrs)
    try:
        return triton.compile(src, target=TARGET, options=options)
    except Exception as e:                # Triton < 3.9 ships a ptxas (CUDA 12.8) older than PTX 9.0
        if "Unsupported .version" not in str(e):
            raise
        pytest.skip(f"Triton {triton.__version__}'s ptxas cannot assemble PTX 9.0 (the 580 driver's version)")


def _cpu(t):
    return t.to("cpu")


def _launches_rejection(monkeypatch):
    args = rejection_inputs("cpu", V=4096)
    out = []
    for kw in ({}, {"block_v": 1024, "num_warps": 4}, {"schedule": "row"}):
        out += record(monkeypatch, krj, krj.rejection_sample_triton, *args, **kw)
    for dtype in (torch.float32, torch.bfloat16):    # the logits' finiteness check of the same steps
        out += record(monkeypatch, kfn, kfn.rows_finite_triton, torch.randn(2, 3, 4096, dtype=dtype), slices=2)
    return out


def _launches_markov(monkeypatch):
    args = markov_inputs("cpu", torch.bfloat16, B=1, N=2, V=4096, r=256)
    big = markov_inputs("cpu", torch.bfloat16, B=64, N=2, V=4096, r=256)
    out = []
    for a, kw in ((args, dict(one_launch=False)), (args, dict(one_launch=True)),
                  (args, dict(one_launch=True, packed=False)),
                  (args, dict(one_launch=False, reduce="prologue", gemv=True, snake=True, block_v=64)),
                  (args, dict(one_launch=True, gemv=True, snake=True, block_v=64)),
                  (args, dict(one_launch=True, gemv=True, snake=True, block_v=16, num_warps=4, pipeline=True)),
                  (args, dict(one_launch=False, reduce="prologue", gemv=True, snake=True, l2_keep=0.5)),
                  (big, dict(one_launch=False, snake=True)), (big, {})):     # B=64: rank-128 tiles
        out += record(monkeypatch, kmk, kmk.markov_sample_triton, *a, **kw)
    return out


def _launches_block_attention(monkeypatch):
    q, kc, vc, table, pos, causal, block, scale = block_attention_inputs("cpu", torch.bfloat16, H=32, Hkv=8,
                                                                          D=128, page=16)
    out = []
    for kw in ({}, {"num_splits": 1}, {"block_n": 128, "num_warps": 8, "num_stages": 3, "num_splits": 4},
               *_PREFETCH_CONFIGS, {"prefetch": True, "num_stages": 3, "num_warps": 8, "kvh_first": True},
               {"prefetch": True, "block_n": 128, "num_warps": 8, "num_stages": 3, "num_splits": 1}):
        out += record(monkeypatch, kba, kba.block_attention_triton, q, kc, vc, table, pos, block, scale, **kw)
    return out


_PREFETCH_CONFIGS = [{"prefetch": True, "num_stages": 3, "num_splits": s} for s in (1, 2)] + \
                    [{"prefetch": True, "block_n": 32, "num_stages": 4, "num_splits": 1}]


@pytest.mark.parametrize("cfg", _PREFETCH_CONFIGS, ids=lambda c: f"bn{c.get('block_n', 64)}-ns{c['num_stages']}-s{c['num_splits']}")
def test_block_attention_prefetch_pipelines_kv(monkeypatch, cfg):
    """The point of ``prefetch``: Triton's pipeliner buffers num_stages - 1 K/V tiles in shared
    memory (a page-table load in the same iteration as the K/V loads collapses it to one)."""
    args = block_attention_inputs("cpu", torch.bfloat16, T=8, H=32, Hkv=8, D=128, page=16)
    q, kc, vc, table, pos, causal, block, scale = args
    tile = cfg.get("block_n", kba.ATTN_DEFAULTS["block_n"]) * 128 * 2              # one K (or V) tile, bytes
    shared = {}
    for prefetch in (False, True):
        kernel, a, kw = record(monkeypatch, kba, kba.block_attention_triton, q, kc, vc, table, pos, block,
                               scale, **{**cfg, "prefetch": prefetch})[0]
        shared[prefetch] = compile_launch(kernel, a, kw).metadata.shared
    depth = cfg["num_stages"] - 1
    assert shared[True] >= 2 * depth * tile > shared[False], shared


def _launches_sparse_mla(monkeypatch):
    q, kv, idx, sink, scale, dv = sparse_mla_inputs("cpu", torch.bfloat16, T=3, H=128, D=512, dv=512, S=300,
                                                    W=256)
    out = []
    for kw in ({}, {"num_splits": 4}, {"block_h": 16, "block_dv": 512, "num_splits": 1},
               {"block_h": 32, "block_dv": 512, "block_n": 16, "num_splits": 1},
               {"prefetch": True, "num_splits": 1}, {"block_h": 32, "block_n": 32, "num_stages": 3}):
        out += record(monkeypatch, ksm, ksm.sparse_mla_attention_triton, q, kv, idx, sink, scale, dv, **kw)
    q8 = torch.zeros(8, 128, 512, dtype=torch.bfloat16)         # a block of 8 tokens: programs of G tokens
    for kw in ({"group": 2, "block_h": 32}, {"group": 8, "block_h": 8, "block_n": 32, "block_dv": 256}):
        out += record(monkeypatch, ksm, ksm.sparse_mla_attention_triton, q8, kv, idx[:1].expand(8, -1),
                      sink, scale, dv, **kw)
    return out


_MOE_BIG = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
_GROUPED = {"schedule": "grouped"}
_DECODE = {"schedule": "decode"}


def _launches_moe(monkeypatch):
    """Both schedules of the bf16 / fp32 experts: grouped (default and large tiles) and decode
    (default and wide tiles)."""
    out = []
    for dtype, configs in ((torch.bfloat16, (_GROUPED, _MOE_BIG, _DECODE, {**_DECODE, "block_n": 64, "block_k": 128,
                                                                         "num_warps": 8})),
                           (torch.float32, (_GROUPED, _DECODE))):
        args = moe_inputs("cpu", dtype, M=9, k=6, E=8, d=512, h=256)
        for kw in configs:
            out += record(monkeypatch, (kmoe, kmd), kmoe.moe_experts_triton, *args, **kw)
    return out


def _launches_moe_mxfp4(monkeypatch):
    """The MXFP4 weight format of both schedules: grouped with bf16 x (default tiles, the large
    tile, ``tl.dot_scaled``) and fp32 x; decode with each E2M1 route (int32 words, bytes, the fp8
    conversion's inline PTX, with a register cap), a long block_k and the one-token tile (54 pairs
    otherwise take ``DECODE_WIDE``)."""
    out = []
    configs = {torch.bfloat16: (_GROUPED, _MOE_BIG, {**_GROUPED, "dot_scaled": True}, _DECODE,
                                {**_DECODE, "decode": "bytes"}, {**_DECODE, "decode": "e4m3"},
                                {**_DECODE, "block_n": 8, "block_k": 1024}, {**_DECODE, "decode": "e4m3", "maxnreg": 72},
                                {**_DECODE, "decode": "e4m3", "block_n": 16, "block_k": 512, "num_warps": 4}),
               torch.float32: (_GROUPED, _DECODE, {**_DECODE, "decode": "e4m3"})}
    for dtype, kws in configs.items():
        args = moe_mxfp4_inputs("cpu", dtype, M=9, k=6, E=8, d=512, h=256)
        for kw in kws:
            out += record(monkeypatch, (kmoe, kmd), kmoe.moe_experts_mxfp4_triton, *args, **kw)
    return out


def test_mxfp4_e4m3_decode_halves_the_instructions_per_weight():
    """sm_90 SASS of the MXFP4 gate/up GEMV's K loop at V4-Flash shapes (``moe_decode_sass.py``):
    the ``e4m3`` route (the hardware's fp8 conversion, then one FFMA per weight) issues at most 75 %
    of the ``words`` route's instructions per weight (measured 4.58 against 6.52; these GEMVs are
    issue-bound on the H200, 23-35 % of HBM with ``words``), and converts with ``F2FP...E4M3`` two
    codes per instruction."""
    sass_tool = pytest.importorskip("benchmarks.moe_decode_sass", reason="benchmarks/ is not importable")
    import os
    if not os.path.exists(sass_tool.NVDISASM):
        pytest.skip(f"no nvdisasm in this Triton ({sass_tool.NVDISASM})")
    per_weight, ops = {}, {}
    for decode in ("words", "e4m3"):
        per_weight[decode], ops[decode], _ = sass_tool.loop_instructions(decode)
    assert per_weight["e4m3"] <= 0.75 * per_weight["words"], per_weight
    assert any(op.startswith("F2FP") and "E4M3" in op for op in ops["e4m3"]), ops["e4m3"].most_common(8)


def _launches_fp8(monkeypatch):
    """Every default config family (CUDA-core M <= 4 with split-K, swap-AB tl.dot with 64 and 128
    rows) and odd K, for bf16 and fp32 activations; the one-launch-for-any-M body and the
    host-bucketed launches of engines; the opt-in BITS decode and W8A8 MMA; the in-kernel W8A8
    (``act_quant``) launch of every bucket."""
    from dspark_trt.plugins.fp8_linear import quantize_fp8
    out = []
    w8, s = quantize_fp8(torch.randn(512, 1024))
    w8o, so = quantize_fp8(torch.randn(200, 300))
    for dtype in (torch.bfloat16, torch.float32):
        for M, w, sc in ((1, w8, s), (16, w8, s), (128, w8, s), (3, w8o, so), (40, w8o, so)):
            x = torch.randn(M, w.shape[1]).to(dtype)
            out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w, sc)
    x = torch.randn(1, w8.shape[1]).bfloat16()                      # the opt-in bit-pattern e4m3 decode
    out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w8, s, {**kfp8.default_config(1, *w8.shape), "BITS": True})
    for M in (1, 40):                                               # one launch for any M (engines)
        for w, sc in ((w8, s), (w8o, so)):
            x = torch.randn(M, w.shape[1]).bfloat16()
            out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w, sc, kfp8.by_m_config(*w.shape))
    for bucket, M in ((1, 1), (16, 9), (32, 20), (64, 40)):          # the host-chosen launches of engines
        x = torch.randn(M, w8.shape[1]).bfloat16()
        out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w8, s, bucket=bucket)
    for M, cfg in ((16, dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_stages=3)),    # SCALE_W tl.dot tiles
                   (128, dict(BLOCK_N=128, BLOCK_K=128, BLOCK_M=128, num_warps=8, num_stages=3))):
        x = torch.randn(M, w8.shape[1]).bfloat16()
        out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w8, s, {**cfg, "DOT": True, "SCALE_W": True})
    for M, w, sc in ((256, w8, s), (40, w8o, so)):                 # the opt-in W8A8 (fp8 MMA) variant
        x = torch.randn(M, w.shape[1]).bfloat16()
        out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w, sc, kfp8.mma_config(M, *w.shape))
    for bucket, M, w, sc in ((1, 1, w8, s), (16, 9, w8, s), (64, 40, w8o, so), (128, 130, w8, s)):  # in-kernel W8A8
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(M, w.shape[1]).to(dtype)
            out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w, sc, bucket=bucket, act_quant=True)
    x = torch.randn(64, w8.shape[1]).bfloat16()                     # fp8 dots added into fp32 once per group
    out += record(monkeypatch, kfp8, kfp8.fp8_gemm, x, w8, s, dict(BLOCK_N=64, BLOCK_K=128, DOT=True, BLOCK_M=64,
                                                                  ACC_K=128), act_quant=True)
    return out


def _launches_decode_gemv(monkeypatch):
    """Every prologue (the residual sum written in either pass), the measured Qwen3-8B tiles and
    the default one, the rows kernel at 8 and 5 tokens (tensor cores), at 5 on the CUDA cores and
    split K (the ticket reduction) in both bodies, one token on it in both, ``PREFETCH`` in both
    kernels' CUDA-core bodies, ``K_STAGES`` in both, fp8 weights with block scales (``w_scale``) in
    both kernels' bodies, each also with PDL (``_with_pdl``)."""
    N, K = 4096, 4096
    w = torch.randn(N, K).bfloat16()
    x, r, g = torch.randn(K).bfloat16(), torch.randn(K).bfloat16(), torch.randn(K).bfloat16()
    out = []
    for kw in (dict(prologue="none"), dict(prologue="none", residual=r, residual_out=torch.empty_like(r)),
               dict(prologue="rmsnorm", norm_weight=g), dict(prologue="rmsnorm", norm_weight=g, residual=r,
                                                             residual_out=torch.empty_like(r), pre_k=1024),
               dict(config=kdg.CONFIGS[(24576, 4096)]), dict(config=kdg.DEFAULT),
               dict(prologue="rmsnorm", norm_weight=g, config=dict(BLOCK_N=8, BLOCK_K=1024, PREFETCH=True)),
               dict(prologue="rmsnorm", norm_weight=g, config=dict(BLOCK_N=8, BLOCK_K=1024, K_STAGES=3))):
        out += record(monkeypatch, kdg, kdg.decode_gemv, x, w, **kw)
    out += record(monkeypatch, kdg, kdg.decode_gemv, torch.randn(2 * K).bfloat16(), w, "swiglu")
    rows = (kdg, kdr)                                # a verify block / a few rows: decode_rows' kernel
    for M in (8, 5):
        xm, rm = torch.randn(M, K).bfloat16(), torch.randn(M, K).bfloat16()
        out += record(monkeypatch, rows, kdg.decode_gemv, xm, w, "rmsnorm", norm_weight=g, residual=rm,
                      residual_out=torch.empty_like(rm))
        out += record(monkeypatch, rows, kdg.decode_gemv, torch.randn(M, 2 * K).bfloat16(), w, "swiglu")
    for dot in (True, False):                        # split K, both bodies
        out += record(monkeypatch, rows, kdg.decode_gemv, xm, w, "rmsnorm", norm_weight=g, residual=rm,
                      residual_out=torch.empty_like(rm), config=dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, DOT=dot))
    out += record(monkeypatch, rows, kdg.decode_gemv, xm, w, "rmsnorm", norm_weight=g, residual=rm,   # CUDA cores
                  residual_out=torch.empty_like(rm), config=dict(kdg.DEFAULT, DOT=False))
    for dot in (True, False):                        # one token on the rows kernel (a ROWS tile), split K
        out += record(monkeypatch, rows, kdg.decode_gemv, x, w, "rmsnorm", norm_weight=g, residual=r,
                      residual_out=torch.empty_like(r),
                      config=dict(BLOCK_N=64 if dot else 16, BLOCK_K=128, SPLIT_K=4, DOT=dot, ROWS=True))
    out += record(monkeypatch, rows, kdg.decode_gemv, x, w, "rmsnorm", norm_weight=g, residual=r,
                  residual_out=torch.empty_like(r),
                  config=dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, DOT=False, ROWS=True, PREFETCH=True))
    out += record(monkeypatch, rows, kdg.decode_gemv, x, w, "rmsnorm", norm_weight=g, residual=r,
                  residual_out=torch.empty_like(r),
                  config=dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, DOT=False, ROWS=True, K_STAGES=3))
    from dspark_trt.plugins.fp8_linear import quantize_fp8     # fp8 weights, block scales: both kernels, every body
    w8, s = quantize_fp8(torch.randn(N, K))
    for xs, kw in ((x, dict(config=dict(BLOCK_N=8, BLOCK_K=512, PREFETCH=True))),
                   (x, dict(config=dict(BLOCK_N=8, BLOCK_K=1024, K_STAGES=3))),
                   (x, dict(config=dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, DOT=False, ROWS=True))),
                   (xm, {}), (xm, dict(config=dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, DOT=False, PREFETCH=True)))):
        res = rm if xs.dim() > 1 else r
        out += record(monkeypatch, rows, kdg.decode_gemv, xs, w8, "rmsnorm", norm_weight=g, residual=res,
                      residual_out=torch.empty_like(res), w_scale=s, **kw)
    out += record(monkeypatch, rows, kdg.decode_gemv, torch.randn(8, 2 * K).bfloat16(), w8, "swiglu", w_scale=s)
    out += record(monkeypatch, kdg, kdg.decode_gemv, torch.randn(2 * K).bfloat16(), w8, "swiglu", w_scale=s)
    return _with_pdl(out)


def _with_pdl(launches: list) -> list:
    """The launches as recorded and each again with ``PDL`` (the wrappers refuse PDL off a GPU;
    ``PDL`` is the constexpr its launch option comes with)."""
    return launches + [(k, a, {**kw, "PDL": True}) for k, a, kw in launches]


def _launches_qk_rope_cache(monkeypatch):
    """Qwen3-8B heads (32 q, 8 kv of 128) and a small GQA shape, each also with PDL."""
    out = []
    for H, Hkv, D in ((32, 8, 128), (4, 2, 16)):
        qkv, n = torch.randn((H + 2 * Hkv) * D).bfloat16(), torch.ones(D).bfloat16()
        cache = torch.zeros(5, 16, Hkv, D).bfloat16()
        out += record(monkeypatch, kqr, kqr.qk_rope_cache, qkv, n, n, n, n, cache, cache.clone(),
                      torch.arange(4), torch.tensor([17]), H, 1e-6)
    return _with_pdl(out)


def _launches_token_step_attention(monkeypatch):
    """The token chain's attention (one query token, Qwen3-8B heads): split and reduce, the splits'
    ticket merge, or one split, each with PDL."""
    q, kc, vc, table, pos, *_ = block_attention_inputs("cpu", torch.bfloat16, H=32, Hkv=8, D=128, page=16)
    out = []
    for splits, reduce in ((3, "two_pass"), (3, "ticket"), (1, "two_pass")):
        out += record(monkeypatch, kba, kba.block_attention_triton, q[:1, :1], kc, vc, table[:1], pos[:1, :1],
                      pos[:1, :1], 0.088, num_splits=splits, reduce=reduce)
    return _with_pdl(out)


@pytest.mark.parametrize("op", ["rejection", "markov", "block_attention", "sparse_mla", "moe", "moe_mxfp4", "fp8",
                                "decode_gemv", "qk_rope_cache", "token_step_attention"])
def test_launches_compile_for_sm90(monkeypatch, op):
    launches = globals()[f"_launches_{op}"](monkeypatch)
    seen = set()
    for kernel, args, kwargs in launches:
        key = (kernel.__name__, tuple(sorted((k, v) for k, v in kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        k = compile_launch(kernel, args, kwargs)
        assert k.asm["ptx"].count(".entry") == 1
        assert k.metadata.shared <= SM90_MAX_SHARED, (kernel.__name__, kwargs, k.metadata.shared)


def _float_launches(op: str, monkeypatch) -> list:
    """The default launch of each of ``op``'s kernels that takes a Python-float argument."""
    firsts = {}
    for kernel, args, kwargs in globals()[f"_launches_{op}"](monkeypatch):
        if any(isinstance(a, float) for a in args):
            firsts.setdefault(kernel.__name__, (kernel, args, kwargs))
    assert firsts, f"{op}: no launch with a float argument"
    return list(firsts.values())


@pytest.mark.parametrize("op", ["block_attention", "sparse_mla", "moe", "moe_mxfp4", "decode_gemv", "qk_rope_cache"])
def test_float_scalars_passed_as_fp64_compile(monkeypatch, op):
    """AOTInductor (Triton 3.6) passes Python-float arguments (scales, limits) as fp64: each kernel
    with a float argument casts it, so no fp64 reaches a loop-carried fp32 value. Uncast, the
    frontend fails ("Loop-carried variable m_i has initial type fp32 but is re-assigned to fp64")."""
    for kernel, args, kwargs in _float_launches(op, monkeypatch):
        k = compile_launch(kernel, args, kwargs, float_type="fp64")
        assert k.asm["ptx"].count(".entry") == 1



@pytest.mark.parametrize("op", ["block_attention", "sparse_mla", "moe", "decode_gemv", "qk_rope_cache"])
def test_float_scalars_passed_as_constants_compile(monkeypatch, op):
    """torch's mutation analysis of a user Triton kernel (torch.export / AOTInductor, torch 2.11)
    generates its TTIR with Python-float arguments as plain Python floats: a kernel that calls a
    tensor method on one (``scale.to(...)``) fails there; torch only warns, assumes every input is
    mutated, and the package returns extra outputs (seen on the H200: 3 leaves for 1)."""
    for kernel, args, kwargs in _float_launches(op, monkeypatch):
        floats = {n: a for n, a in zip(kernel.arg_names, args) if isinstance(a, float)}
        rest = [None if n in floats else a for n, a in zip(kernel.arg_names, args)]
        k = compile_launch(kernel, rest, {**kwargs, **floats})
        assert k.asm["ptx"].count(".entry") == 1


@pytest.mark.parametrize("op", ["decode_gemv", "qk_rope_cache", "token_step_attention"])
def test_pdl_launches_wait_for_their_predecessor(monkeypatch, op):
    """With ``PDL`` each kernel of the token chain (the GEMV, the q/k norm + RoPE + cache write,
    attention's split / single and reduce kernels) signals its dependents and waits
    (griddepcontrol) before it reads its inputs; without it neither instruction is emitted."""
    firsts = {}
    for kernel, args, kwargs in globals()[f"_launches_{op}"](monkeypatch):
        firsts.setdefault(kernel.__name__, (kernel, args, kwargs))
    for kernel, args, kwargs in firsts.values():
        ptx = {pdl: compile_launch(kernel, args, {**kwargs, "PDL": pdl}).asm["ptx"] for pdl in (False, True)}
        assert "griddepcontrol.wait" in ptx[True] and "griddepcontrol.launch_dependents" in ptx[True], kernel
        assert "griddepcontrol" not in ptx[False], kernel
        # what does not depend on the predecessor loads before the wait (weights; the step's indices,
        # norm weights, cos / sin); the attention merge reads nothing but its predecessor's partials
        loads_early = 0 < ptx[True].find("ld.global") < ptx[True].find("griddepcontrol.wait")
        assert loads_early == (kernel.__name__ != "block_attention_reduce_kernel"), kernel
    if op == "token_step_attention":
        assert len(firsts) == 3                 # split, reduce and single-split kernels


def test_mla_resources_reads_registers_and_mma_kind(monkeypatch, tmp_path):
    """``benchmarks/mla_resources.py`` (the sm_90 screen of the sparse MLA configs): 32-row tiles
    (the earlier default's 32 heads) are ``mma.sync``, the default's 64 rows ``wgmma``, and so are
    64 rows of a group of 2 tokens x 32 heads; registers are read from the cubin (at most 255 a
    thread) into the JSON."""
    import json
    from benchmarks import mla_resources
    monkeypatch.setattr(mla_resources, "MLA_CONFIGS", [{"block_h": 32, "block_n": 32}, {},
                                                       {"group": 2, "block_h": 32, "block_n": 32, "block_dv": 256}])
    assert mla_resources.main(["--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("mla-resources-sm90-*.json")).read_text())["configs"]
    assert [(r["rows_per_mma"], r["mma"]) for r in rows] == [(32, "mma.sync"), (64, "wgmma"), (64, "wgmma")]
    assert all(0 < r["registers"] <= 255 and r["stack"] >= 0 and r["shared_bytes"] > 0 for r in rows)
