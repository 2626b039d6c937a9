"""Triton kernels vs references on a CUDA GPU: the small CPU cases, then moderately real shapes
in bf16 (tokens and indices exact; float tolerances stated per test), CUDA-graph capture, and the
torch op dispatching to the kernel."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():            # before the kernel imports: they need Triton
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import dspark_trt.plugins  # noqa: E402,F401
from dspark_trt.plugins.block_attention import block_attention_ref  # noqa: E402
from dspark_trt.plugins.kernels.block_attention import block_attention_triton  # noqa: E402
from dspark_trt.plugins.markov_sample import markov_sample_ref, markov_sample_topk_ref  # noqa: E402
from dspark_trt.plugins.rejection_sample import apply_top_p, rejection_sample_ref  # noqa: E402
from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_ref  # noqa: E402

from tests.support.plugins_cases import run_all  # noqa: E402

DEV = "cuda"


def test_small_cases_fp32():
    r = run_all(DEV)
    assert r["kv_cache_write"]["err"] == 0 and r["kv_cache_write"]["pad_page_untouched"]
    assert not r["tuner_configs"]["failures"]
    for k, v in r.items():                        # every case: exact tokens, fp32 tolerance 1e-4
        assert v.get("tokens_equal", True), k
        assert v.get("err", 0.0) < 1e-4, k


def _markov_args(B=5, N=7, V=151936, r=256):
    g = torch.Generator(device=DEV).manual_seed(0)
    U = torch.randn(B, N, V, device=DEV, generator=g).to(torch.bfloat16) * 3
    w1 = (torch.randn(V, r, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(V, r, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
    anchor = torch.tensor([3, -1, 77, 151000, 9], device=DEV).repeat(-(-B // 5))[:B]   # a dead row (-1) in each 5
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.5], device=DEV).repeat(-(-B // 5))[:B]
    seed = torch.arange(B, device=DEV) + (1 << 40)
    start = torch.arange(B, device=DEV) * 100
    return U, anchor, w1, w2, temp, seed, start


ONE_GEMV = dict(one_launch=True, gemv=True, block_v=16, num_warps=4)


@pytest.mark.parametrize("B, schedule", [(5, dict(one_launch=True)), (5, dict(one_launch=False)),
                                         (5, dict(rows_only=True)), (1, {}),
                                         (1, dict(ONE_GEMV, resident_per_sm=64)),
                                         (1, dict(ONE_GEMV, resident_per_sm=6, pipeline=True)),
                                         (4, dict(ONE_GEMV, resident_per_sm=64)),
                                         (4, dict(one_launch=False, gemv=True, reduce="prologue", pipeline=True)),
                                         (5, dict(one_launch=True, packed=False)), (64, {})],
                         ids=["one_launch", "per_step", "rows", "b1_default", "b1_gemv_clamped", "b1_gemv_pipeline",
                              "b4_gemv_clamped", "b4_gemv_prologue_pipeline", "one_launch_partials",
                              "b64_default"])
def test_markov_real_vocab_tokens_exact(B, schedule):
    """*_clamped ask for 64 programs per SM: without the residency clamp the grid barrier would
    wait forever for programs that cannot be scheduled."""
    from dspark_trt.plugins.kernels.markov_launch import markov_sample_triton
    args = _markov_args(B=B)
    rt, rz = markov_sample_ref(*args)
    t, z = markov_sample_triton(*args, **schedule)
    assert torch.equal(t, rt)
    assert (z - rz).abs().max() < 1e-3                  # fp32 sums of bf16 products, different order


def test_markov_b1_sampled_tokens_exact():
    """Batch 1, temperature > 0, the default one-launch grid (its greedy rows skip the noise, so the
    sampled branch needs its own case)."""
    from dspark_trt.plugins.kernels.markov_launch import markov_sample_triton
    args = _markov_args(B=1)
    args = (*args[:4], torch.full((1,), 0.8, device=DEV), *args[5:])
    rt, rz = markov_sample_ref(*args)
    t, z = markov_sample_triton(*args)
    assert torch.equal(t, rt)
    assert (z - rz).abs().max() < 1e-3


def test_markov_fast_mode_matches_its_reference():
    from dspark_trt.plugins.kernels.markov_topk import markov_sample_topk_triton
    args = _markov_args()
    rt, rz = markov_sample_topk_ref(*args, 4096, 4)
    t, z = markov_sample_topk_triton(*args, 4096, 4)
    assert torch.equal(t, rt)
    fin = torch.isfinite(rz)
    assert torch.equal(fin, torch.isfinite(z)) and (z[fin] - rz[fin]).abs().max() < 1e-3


def test_markov_op_in_cuda_graph():
    args = _markov_args(B=2, V=32000, r=64)
    rt, _ = markov_sample_ref(*args)
    torch.ops.dspark.markov_sample(*args)               # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        t, z = torch.ops.dspark.markov_sample(*args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(t, rt)


@pytest.mark.parametrize("B,T,ctx,spare", [(3, 8, 1000, 0), (1, 1, 4000, 0), (64, 8, 300, 0),
                                           (1, 1, 100, 250)])   # a short context in a long table: most splits empty
def test_block_attention_qwen_shapes_bf16(B, T, ctx, spare):
    H, Hkv, D, page = 32, 8, 128, 16
    pages = -(-(ctx + T) // page) + spare
    table = torch.randperm(B * pages, device=DEV).view(B, pages)
    kc = torch.randn(B * pages + 1, page, Hkv, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16)
    pos = (ctx + torch.arange(T, device=DEV)).expand(B, T).contiguous()
    for lim in (pos, torch.full_like(pos, ctx + T - 1)):
        ref = block_attention_ref(q, kc, vc, table, pos, lim, D ** -0.5)
        got = torch.ops.dspark.block_attention(q, kc, vc, table, pos, lim, D ** -0.5)
        assert (got.float() - ref.float()).abs().max() < 2e-2      # bf16 output, bf16 P in P @ V
        for cfg in ({"prefetch": True, "num_stages": 3}, {"prefetch": True, "num_stages": 3, "num_splits": 3,
                                                          "kvh_first": True}, {"reduce": "ticket"}):
            alt = block_attention_triton(q, kc, vc, table, pos, lim, D ** -0.5, **cfg)
            assert (alt.float() - ref.float()).abs().max() < 2e-2, cfg
        g = torch.cuda.CUDAGraph()                                  # split-KV workspace under capture
        with torch.cuda.graph(g):
            out = torch.ops.dspark.block_attention(q, kc, vc, table, pos, lim, D ** -0.5)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("T,start,block", [(128, 0, False), (8, 128, False), (7, 128, True), (7, 129, True),
                                           (7, 132, True), (8, 190, False)])
def test_block_attention_default_pair_shapes_bf16(B, T, start, block):
    """The shipped default pair's attention (8 heads on 4 KV heads of 64, pages of 64: a query
    tile of 8 tokens x 2 heads, which the Qwen3-8B shapes above never launch): the prompt's
    prefill, the verify window and the draft block (non-causal) at the first positions past a
    128-token prompt, where session 43's GPU traces parted from the CPU's rounds, and a verify at
    190; two spare pages (empty KV splits); the op, the chain's launch with PDL, and a replay
    under a CUDA graph."""
    H, Hkv, D, page = 8, 4, 64, 64
    pages = -(-(start + T) // page) + 2
    table = torch.randperm(B * pages, device=DEV).view(B, pages)
    kc = torch.randn(B * pages + 1, page, Hkv, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16)
    pos = (start + torch.arange(T, device=DEV)).expand(B, T).contiguous()
    lim = torch.full_like(pos, start + T - 1) if block else pos
    ref = block_attention_ref(q.float(), kc.float(), vc.float(), table, pos, lim, D ** -0.5)
    got = torch.ops.dspark.block_attention(q, kc, vc, table, pos, lim, D ** -0.5)
    assert (got.float() - ref).abs().max() < 2e-2                   # bf16 output, bf16 P in P @ V
    pdl = block_attention_triton(q, kc, vc, table, pos, lim, D ** -0.5, pdl=True)
    assert (pdl.float() - ref).abs().max() < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.dspark.block_attention(q, kc, vc, table, pos, lim, D ** -0.5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.parametrize("Tq", [2, 8, 16, 256])     # 2: the index list is split; 8, 16: 16-head tiles
def test_sparse_mla_v4_shapes_bf16(Tq):
    H, D, S, W = 128, 512, 2000, 256
    q = torch.randn(Tq, H, D, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(S, D, device=DEV, dtype=torch.bfloat16)
    idx = torch.randint(0, S, (Tq, W), device=DEV, dtype=torch.int32)
    idx[:, 200:] = -1
    sink = torch.randn(H, device=DEV)
    ref = sparse_mla_attention_ref(q, kv, idx, sink, D ** -0.5, D)
    got = torch.ops.dspark.sparse_mla_attention(q, kv, idx, sink, D ** -0.5, D)
    assert (got.float() - ref.float()).abs().max() < 2e-2
    from dspark_trt.plugins.kernels.sparse_mla import sparse_mla_attention_triton
    # the default above (16 or 64 heads by the token count, 64 entries); the earlier default (32 x 32)
    # and variations
    for cfg in ({"block_h": 32, "block_n": 32}, {"block_h": 32, "block_n": 32, "num_stages": 3},
                {"prefetch": False}, {"num_stages": 1}, {"block_h": 64}, {"block_h": 16, "num_splits": 1}):
        alt = sparse_mla_attention_triton(q, kv, idx, sink, D ** -0.5, D, **cfg)
        assert (alt.float() - ref.float()).abs().max() < 2e-2, cfg


@pytest.mark.parametrize("cfg", [{}, {"group": 2, "block_h": 32},
                                 {"group": 2, "block_h": 32, "block_n": 32, "block_dv": 256},
                                 {"group": 8, "block_h": 8, "block_n": 32, "block_dv": 256},
                                 {"block_n": 32, "block_dv": 256}])
def test_sparse_mla_v4_block_lists_bf16(cfg):
    """The V4 verify block's lists (every query of a row's 8-token block sees one list,
    ``noncausal_swa_indices``; window 128, width 256, pages of 64, one row inert): the 64-row-MMA
    launches, G tokens a program included, equal the reference."""
    from dspark_trt.plugins.kernels.sparse_mla import sparse_mla_attention_triton
    from dspark_trt.plugins.noncausal_swa_indices import noncausal_swa_indices_ref
    B, N, H, D, page = 4, 8, 128, 512, 64
    start = torch.tensor([1000, 5, -1, 300], device=DEV)
    table = torch.arange(B * 20, device=DEV).view(B, 20)
    idx, _ = noncausal_swa_indices_ref(start, table, N, page, 128, 256)
    idx = idx.view(B * N, 256)
    q = torch.randn(B * N, H, D, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(B * 20 * page, D, device=DEV, dtype=torch.bfloat16)
    sink = torch.randn(H, device=DEV)
    ref = sparse_mla_attention_ref(q, kv, idx, sink, D ** -0.5, D)
    got = sparse_mla_attention_triton(q, kv, idx, sink, D ** -0.5, D, **cfg)
    assert (got.float() - ref.float()).abs().max() < 2e-2


def test_sparse_mla_bucketed_engine_network(tmp_path):
    """AOTInductor package of ``sparse_mla_attention_bucketed`` at V4 shapes (128 heads, latent 512),
    token count and list width dynamic: the torch.cond's two tiles (16 heads up to the few-token
    limit, else 64) run, within bf16 rounding of the reference, on both sides of the limit and
    under CUDA-graph capture."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export import Dim
    from dspark_trt.builder.backends.aoti import inductor_configs, select_compiler
    from dspark_trt.plugins.kernels.sparse_mla import narrow_token_limit
    from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_bucketed
    H, D, S = 128, 512, 2000

    class Attend(torch.nn.Module):
        def forward(self, q, kv, idx, sink):
            return sparse_mla_attention_bucketed(q, kv, idx, sink, D ** -0.5, D)

    def inputs(T, W):
        q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
        idx = torch.randint(0, S, (T, W), device=DEV, dtype=torch.int32)
        idx[:, W * 3 // 4:] = -1
        return q, kv, idx, sink

    kv = torch.randn(S, D, device=DEV, dtype=torch.bfloat16)
    sink = torch.randn(H, device=DEV)
    tokens = Dim("tokens", min=1, max=4096)
    dims = ({0: tokens}, None, {0: tokens, 1: Dim("width", min=1, max=2048)}, None)
    with torch.no_grad():
        ep = torch.export.export(Attend(), inputs(8, 256), dynamic_shapes=dims, strict=False)
    cfg = {k: v for k, v in inductor_configs(select_compiler()).items() if k != "aot_inductor.package_constants_in_so"}
    net = aoti_load_package(aoti_compile_and_package(ep, package_path=str(tmp_path / "mla.pt2"), inductor_configs=cfg),
                            run_single_threaded=True)
    few = narrow_token_limit(H, D, torch.device(DEV))
    for T, W in ((1, 256), (8, 256), (few, 128), (few + 1, 256), (512, 256)):
        args = inputs(T, W)
        out = net(*args)
        ref = sparse_mla_attention_ref(*args, D ** -0.5, D)
        assert (out.float() - ref.float()).abs().max() < 2e-2, (T, W)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_g = net(*args)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, out), (T, W)


def _rejection_args(B, N=7, V=151936, top_p=None):
    g = torch.Generator(device=DEV).manual_seed(1)
    L = torch.randn(B, N + 1, V, device=DEV, generator=g) * 3
    z = L[:, :N] + torch.randn(B, N, V, device=DEV, generator=g) * 0.3
    temp = torch.tensor([0, 1, 0.7, 0, 1, 1.2, 0, 0.5] * (B // 8 + 1), device=DEV)[:B]
    if top_p is not None:
        L = apply_top_p(L, temp, torch.full((B,), top_p, device=DEV))
    drafts = z.argmax(-1)
    seed = torch.arange(B, device=DEV)
    start = (torch.arange(B, device=DEV) + 1) * 10
    if B > 3:
        start[3] = -1                                   # an inert row
    return L, drafts, z, temp, seed, start


@pytest.mark.parametrize("B,top_p", [(1, None), (8, None), (64, None), (8, 0.9)])
@pytest.mark.parametrize("schedule", ["split", "row"])
def test_rejection_sample_real_vocab_exact(B, top_p, schedule):
    from dspark_trt.plugins.kernels.rejection import rejection_sample_triton
    args = _rejection_args(B, top_p=top_p)
    ra, rn = rejection_sample_ref(*args)
    a, n = rejection_sample_triton(*args, schedule=schedule)
    assert torch.equal(a, ra) and torch.equal(n, rn)


def test_rejection_sample_op_in_cuda_graph():
    args = _rejection_args(4)
    ra, rn = rejection_sample_ref(*args)
    torch.ops.dspark.rejection_sample(*args)            # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a, n = torch.ops.dspark.rejection_sample(*args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, ra) and torch.equal(n, rn)


@pytest.mark.parametrize("B", [1, 3, 16, 64])
def test_sample_tokens_real_vocab_exact(B):
    """The AR step's sampler (``kernels/sample.py``, what ``sample_tokens`` runs on a GPU) against the
    torch reference at Qwen3's vocabulary in bf16, greedy and sampled rows, also replayed from a
    CUDA graph; the noise moves sampled rows off the argmax."""
    from dspark_trt.plugins.rejection_sample import sample_tokens, sample_tokens_ref
    g = torch.Generator(device=DEV).manual_seed(B)
    logits = (torch.randn(B, 151936, device=DEV, generator=g) * 2).to(torch.bfloat16)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3], device=DEV).repeat(-(-B // 4))[:B]
    seed = torch.arange(B, device=DEV) * 7919 + 5
    pos = torch.arange(B, device=DEV) + 100
    ref = sample_tokens_ref(logits, temp, seed, pos)
    assert torch.equal(sample_tokens(logits, temp, seed, pos), ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_tokens(logits, temp, seed, pos)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    greedy = temp <= 0
    assert torch.equal(ref[greedy], logits[greedy].argmax(-1))
    if B > 1:
        assert (ref[~greedy] != logits[~greedy].argmax(-1)).any()


def test_markov_all_greedy_batch_real_vocab_tokens_exact():
    """A batch of greedy rows only (the serving default): the row groups skip the Gumbel noise; tokens
    and z as the reference's, at batch 64 (one launch) and 16 (per step)."""
    from dspark_trt.plugins.kernels.markov_launch import markov_sample_triton
    for B in (64, 16):
        U, anchor, w1, w2, _, seed, start = _markov_args(B=B)
        args = (U, anchor, w1, w2, torch.zeros(B, device=DEV), seed, start)
        rt, rz = markov_sample_ref(*args)
        t, z = markov_sample_triton(*args)
        assert torch.equal(t, rt) and (z - rz).abs().max() < 1e-3, B


@pytest.mark.parametrize("B, W", [(1, 1), (64, 8), (3, 4)])
def test_rows_finite_real_vocab(B, W):
    """``rows_finite`` (``kernels/finite.py``) on bf16 logits at Qwen3's vocabulary: NaN, +Inf, -Inf
    each flag their row alone, as the reference, also replayed from a CUDA graph."""
    from dspark_trt.plugins.finite import rows_finite, rows_finite_ref
    x = (torch.randn(B, W, 151936, device=DEV) * 20).to(torch.bfloat16)
    bad = {0: float("nan"), B // 2 + (B > 1): float("inf"), B - 1: -float("inf")} if B > 2 else {0: float("nan")}
    for r, v in bad.items():
        x[r, W - 1, 151935 - r] = v
    ref = rows_finite_ref(x)
    assert ref.tolist() == [r not in bad for r in range(B)]
    got = rows_finite(x)
    assert got.dtype == torch.bool and torch.equal(got, ref)     # bool: a torch.where condition
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows_finite(x)
    x[:] = 1.0
    graph.replay()
    torch.cuda.synchronize()
    assert out.all()
