"""Small random inputs for every dspark op, shared by the CPU interpreter tests and the GPU tests.

Each ``case_<op>(device, dtype, **shape)`` returns ``(inputs, kwargs)`` for the op; ``compare``
runs a kernel launcher against the reference and returns numbers (max abs error, token equality).
"""
from __future__ import annotations

import torch

from dspark_trt.plugins.block_attention import block_attention_ref
from dspark_trt.plugins.kv_cache import kv_cache_write_ref
from dspark_trt.plugins.markov_sample import markov_sample_ref, markov_sample_topk_ref
from dspark_trt.plugins.moe_experts import moe_experts_ref
from dspark_trt.plugins.noncausal_swa_indices import index_width, noncausal_swa_indices_ref
from dspark_trt.plugins.rejection_sample import rejection_sample_ref
from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_ref


def _gen(device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def paged_table(B, pages_per_row, num_pages, device, seed=0, dead_rows=()):
    """Block table [B, P] of distinct random pages; rows in dead_rows are all -1."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)[: B * pages_per_row].view(B, pages_per_row)
    for r in dead_rows:
        perm[r] = -1
    return perm.to(device)


def kv_cache_inputs(device, dtype=torch.float32, B=3, T=5, Hkv=2, D=16, page=4, P=4):
    r = _gen(device)
    num_pages = B * P + 2
    kc = r(num_pages + 1, page, Hkv, D, dtype=dtype)
    vc = r(num_pages + 1, page, Hkv, D, dtype=dtype)
    k, v = r(B, T, Hkv, D, dtype=dtype), r(B, T, Hkv, D, dtype=dtype)
    table = paged_table(B, P, num_pages, device, dead_rows=(2,))
    pos = torch.arange(T, device=device)[None, :] + torch.tensor([0, 9, 1], device=device)[:, None]
    pos[0, 1] = -1                                          # inert token
    pos[1, -1] = P * page + 3                               # beyond the table: inert
    return kc, vc, k, v, table, pos


def block_attention_inputs(device, dtype=torch.float32, B=3, T=4, H=8, Hkv=2, D=16, page=4, P=6):
    r = _gen(device, 1)
    num_pages = B * P
    kc = r(num_pages + 1, page, Hkv, D, dtype=dtype)
    vc = r(num_pages + 1, page, Hkv, D, dtype=dtype)
    q = r(B, T, H, D, dtype=dtype)
    table = paged_table(B, P, num_pages, device, dead_rows=(2,))
    start = torch.tensor([3, 17, 5], device=device)
    pos = start[:, None] + torch.arange(T, device=device)
    pos[0, 2] = -1
    causal = pos.clone()
    block = (start + T - 1)[:, None].expand(B, T).contiguous()
    return q, kc, vc, table, pos, causal, block, D ** -0.5


def markov_inputs(device, dtype=torch.float32, B=3, N=3, V=300, r=16):
    g = _gen(device, 2)
    U = (g(B, N, V) * 2).to(dtype)
    w1 = (g(V, r) * 0.5).to(dtype)
    w2 = (g(V, r) * 0.5).to(dtype)
    anchor = torch.tensor([5, -1, 7, 11, 2, 9, 4, 1][:B], device=device)
    anchor = torch.cat([anchor, torch.arange(max(0, B - 8), device=device)])[:B]
    temp = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.3, 0.5, 0.0, 2.0][:B] + [0.7] * max(0, B - 8), device=device)
    seed = torch.arange(B, device=device) * 7919 + (1 << 33) + 5
    start = torch.arange(B, device=device) + 20
    return U, anchor, w1, w2, temp, seed, start


def rejection_inputs(device, dtype=torch.float32, B=6, N=3, V=200):
    g = _gen(device, 3)
    L = (g(B, N + 1, V) * 2).to(dtype)
    z = (L[:, :N].float() + g(B, N, V) * 0.5)                     # draft close to target
    drafts = z.argmax(-1)
    drafts[3, 0] = (L[3, 0].argmax() + 1) % V                      # a rejected greedy draft
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.0, 0.9][:B], device=device)
    seed = torch.arange(B, device=device) + 100
    start = torch.tensor([5, 6, 7, 8, -1, 10][:B], device=device)
    return L, drafts, z, temp, seed, start


def rejection_topp_inputs(device, dtype=torch.float32):
    """Rows masked to -inf (a dead vocabulary prefix longer than a tile, then top-p)."""
    from dspark_trt.plugins.rejection_sample import apply_top_p
    L, _, z, temp, seed, start = rejection_inputs(device, dtype, V=300)
    L[..., :70] = float("-inf")
    z[..., :70] = float("-inf")
    L = apply_top_p(L, temp, torch.tensor([0.9, 0.95, 0.8, 1.0, 0.4, 0.99], device=device))
    return L, z.argmax(-1), z, temp, seed, start


def rejection_many_inputs(device, B=24, N=4, V=97):
    """Many rows, random temperatures, some off-distribution drafts, one inert row."""
    g = _gen(device, 7)
    L = g(B, N + 1, V) * 1.5
    z = L[:, :N] + g(B, N, V) * 0.4
    gi = torch.Generator().manual_seed(8)
    off = torch.rand(B, N, generator=gi) < 0.2
    drafts = torch.where(off.to(device), torch.randint(0, V, (B, N), generator=gi).to(device), z.argmax(-1))
    temp = torch.where(torch.arange(B) % 3 == 0, 0.0, 0.5 + torch.rand(B, generator=gi)).to(device)
    seed = torch.arange(B, device=device) * 31 + 7
    start = torch.arange(B, device=device) * 5
    start[5] = -1
    return L, drafts, z, temp, seed, start


def swa_inputs(device, B=4, N=5, page=8, P=40, window=16):
    table = paged_table(B, P, B * P + 1, device, seed=4)
    start = torch.tensor([3, 100, -1, 250][:B], device=device)
    return start, table, N, page, window, index_width(window, N)


def sparse_mla_inputs(device, dtype=torch.float32, T=3, H=16, D=64, dv=32, S=50, W=24):
    g = _gen(device, 5)
    q, kv = g(T, H, D, dtype=dtype), g(S, D, dtype=dtype)
    gi = torch.Generator().manual_seed(6)
    idx = torch.randint(0, S, (T, W), generator=gi, dtype=torch.int32)
    idx[0, 5:9] = -1
    idx[2] = -1                                                    # no valid entry: output 0
    sink = g(H)
    return q, kv, idx.to(device), sink, D ** -0.5, dv


def sparse_mla_padded_inputs(device, dtype=torch.float32):
    """A 64-wide list padded with -1 like the V4 index lists: row 0 valid in its first 16-entry tile,
    then one valid entry at 40 after a whole -1 tile (the walk must reach it), row 1 valid in its
    first tile only."""
    q, kv, idx, sink, scale, dv = sparse_mla_inputs(device, dtype, W=64)
    idx[0, 16:] = -1
    idx[0, 40] = 7
    idx[1, 16:] = -1
    return q, kv, idx, sink, scale, dv


def sparse_mla_group_inputs(device, dtype=torch.float32, G=2, H=16):
    """Index lists shared by groups of G consecutive tokens (the V4 draft block's): group 0 valid
    in part with -1 holes, group 1 without a valid entry (output 0), group 2 valid throughout."""
    q, kv, idx, sink, scale, dv = sparse_mla_inputs(device, dtype, T=3 * G, H=H)
    first = idx[::G].clone()                                       # [3, W]
    first[0, 5:9] = -1
    first[1] = -1
    first[2] = first[2].clamp(min=0)
    return q, kv, first.repeat_interleave(G, 0).contiguous(), sink, scale, dv


def moe_inputs(device, dtype=torch.float32, M=7, k=3, E=5, d=48, h=40, first_expert=2, limit=0.7):
    """Global ids over [0, first_expert + E + 2): slots of other ranks' experts (below first_expert
    and above the local block), -1 slots, one token repeating an expert, a token with no local slot."""
    g = _gen(device, 9)
    gi = torch.Generator().manual_seed(10)
    ids = torch.randint(0, first_expert + E + 2, (M, k), generator=gi)
    ids[0, 1] = -1
    ids[1] = torch.tensor([first_expert + 1] * k)[:k]             # one expert in every slot
    ids[2] = -1                                                   # no slot at all
    w = torch.rand(M, k, generator=gi)
    x = g(M, d, dtype=dtype)
    w13, w2 = (g(E, 2 * h, d) * d ** -0.5).to(dtype), (g(E, d, h) * h ** -0.5).to(dtype)
    return x, ids.to(device), w.to(device), w13, w2, first_expert, limit


def moe_mxfp4_inputs(device, dtype=torch.float32, M=7, k=3, E=5, d=64, h=32, first_expert=2, limit=0.7):
    """``moe_inputs``' routing (other ranks' ids, -1 slots, a repeated expert, a token with no local
    slot) over MXFP4 experts: ``quant_mxfp4`` of random weights (every code occurs), so that the
    E8M0 exponents vary per 32-column group. -> (x, ids, w, w13_packed, w13_scale, w2_packed,
    w2_scale, first_expert, limit)."""
    from dspark_trt.checkpoints.quant import quant_mxfp4
    x, ids, w, w13, w2, first_expert, limit = moe_inputs("cpu", torch.float32, M, k, E, d, h, first_expert, limit)
    packed = []
    for t in (w13, w2):
        rows = t * torch.logspace(-3, 3, t.shape[-1], base=2)                    # exponents across groups
        q, s = quant_mxfp4(rows.reshape(-1, t.shape[-1]))
        packed += [q.view(torch.uint8).view(*t.shape[:-1], -1), s.view(torch.uint8).view(*t.shape[:-1], -1)]
    return (x.to(device, dtype), ids.to(device), w.to(device), *(t.to(device) for t in packed), first_expert, limit)


def _err(a, b):
    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return float(torch.where(both_inf, 0.0, (a - b).abs()).max()) if a.numel() else 0.0


def packed_argmax_case(device) -> dict:
    """``atomic_max`` of ``markov._pack_best`` from several programs equals ``torch.argmax`` (first
    index on ties): negative scores, -inf, the maximum at several indices, -0.0 tied with +0.0."""
    g = torch.Generator().manual_seed(3)
    rows = [-torch.rand(40, generator=g) - 1.0, torch.randn(40, generator=g), torch.full((40,), float("-inf"))]
    tied = torch.randn(40, generator=g)
    tied[[7, 23, 31]] = tied.max() + 1.0                       # the maximum in three programs' blocks
    zeros = torch.full((40,), -1.0)
    zeros[[5, 30]] = torch.tensor([-0.0, 0.0])
    rows += [tied, zeros]
    scores = torch.stack(rows).to(device)                      # [5, 40]: one slot per row
    slots = torch.zeros(len(rows), dtype=torch.int64, device=device)
    got = torch.empty(len(rows), dtype=torch.int64, device=device)
    from tests.support.plugins_packed import fold_packed as fold, unpack_packed as unpack     # imports Triton
    for r in range(len(rows)):
        fold[(5,)](scores[r], slots[r:], 40, BLOCK=8)
    unpack[(len(rows),)](slots, got)
    return {"tokens_equal": bool(torch.equal(got.cpu(), scores.cpu().argmax(1)))}


def _kv_cache_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import kv_cache as kkv
    kc, vc, k, v, table, pos = kv_cache_inputs(device, dtype)
    rk, rv = kc.clone(), vc.clone()
    kv_cache_write_ref(rk, rv, k, v, table, pos)
    pad = kc.shape[0] - 1                                  # the reference may scribble on the pad page
    tk, tv = kc.clone(), vc.clone()
    kkv.kv_cache_write_triton(tk, tv, k, v, table, pos)
    out["kv_cache_write"] = {"err": max(_err(tk[:pad], rk[:pad]), _err(tv[:pad], rv[:pad])),
                             "pad_page_untouched": bool(torch.equal(tk[pad], kc[pad]))}


def _block_attention_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import block_attention as kba, common as kcommon
    q, kc, vc, table, pos, causal, block, scale = block_attention_inputs(device, dtype)
    for name, lim in (("causal", causal), ("block", block)):
        ref = block_attention_ref(q, kc, vc, table, pos, lim, scale)
        for splits in (1, 3, 8):                          # 8 splits: some splits get no keys
            for variant, kw in (("", {}), ("_prefetch", dict(prefetch=True, num_stages=3)),
                                ("_kvh_first", dict(kvh_first=True)), ("_ticket", dict(reduce="ticket"))):
                got = kba.block_attention_triton(q, kc, vc, table, pos, lim, scale, num_splits=splits,
                                                 block_n=16, **kw)
                out[f"block_attention_{name}{variant}_split{splits}"] = {"err": _err(got, ref)}
        got = kba.block_attention_triton(q, kc, vc, table, pos, lim, scale, num_splits=8, block_n=16,
                                         reduce="ticket")
        again = kba.block_attention_triton(q, kc, vc, table, pos, lim, scale, num_splits=8, block_n=16,
                                           reduce="ticket")
        out[f"block_attention_{name}_ticket_again"] = {     # the counters are left at zero for reuse
            "equal": bool(torch.equal(again, got)),
            "counters_zero": all(int(b.abs().sum()) == 0 for b in kcommon._COUNTERS.get(q.device, []))}
        packed, index, expected = grouped_inputs(q, pos, ref)
        for splits in (1, 3, 8):
            for reduce in ("two_pass", "ticket"):
                got = kba.block_attention_triton(packed, kc, vc, table, pos, lim, scale, num_splits=splits,
                                                 block_n=16, reduce=reduce, q_index=index)
                out[f"block_attention_{name}_indexed_{reduce}_split{splits}"] = {
                    "err": _err(got, expected), "shape": list(got.shape) == list(packed.shape)}


def grouped_inputs(q, pos, window_out):
    """The window queries q [B, T, H, D] as packed rows [R, 1, H, D] in a shuffled order with two
    rows no token names, the window -> row index (-1 where the position is -1) and the packed rows
    the window output ``window_out`` gives (zeros for the two)."""
    B, T, H, D = q.shape
    live = (pos >= 0).flatten()
    n = int(live.sum())
    order = torch.randperm(n + 2, generator=torch.Generator().manual_seed(3)).to(q.device)
    index = torch.full((B * T,), -1, dtype=torch.int32, device=q.device)
    index[live] = order[:n].to(torch.int32)
    packed = torch.randn(n + 2, 1, H, D, generator=torch.Generator().manual_seed(4)).to(q)
    packed[order[:n], 0] = q.reshape(B * T, H, D)[live]
    expected = torch.zeros_like(packed)
    expected[order[:n], 0] = window_out.reshape(B * T, H, D)[live]
    return packed, index.view(B, T), expected


def _markov_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import markov_launch as kmk, markov_topk as kmt
    args = markov_inputs(device, dtype)
    rt, rz = markov_sample_ref(*args)
    tiles = dict(num_programs=3, block_v=64, block_r=16)
    schedules = {"one": dict(one_launch=True), "per_step": dict(one_launch=False),
                 "prologue": dict(one_launch=False, reduce="prologue"),
                 "dot_snake": dict(one_launch=False, snake=True),
                 "gemv": dict(one_launch=False, reduce="prologue", gemv=True, snake=True, block_v=32),
                 "gemv_ticket": dict(one_launch=False, gemv=True, snake=True, block_v=32, l2_keep=0.4),
                 "one_gemv": dict(one_launch=True, gemv=True, snake=True, block_v=32),
                 "one_gemv_pipeline": dict(one_launch=True, gemv=True, snake=True, block_v=32, pipeline=True),
                 "gemv_ticket_pipeline": dict(one_launch=False, gemv=True, block_v=32, pipeline=True, l2_keep=0.4),
                 "one_unpacked": dict(one_launch=True, packed=False)}
    for name, kw in schedules.items():
        tt, tz = kmk.markov_sample_triton(*args, **{**tiles, **kw})
        out[f"markov_sample_{name}"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    tt, tz = kmk.markov_sample_triton(*args, rows_only=True, block_v=64, block_r=16)
    out["markov_sample_rows"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    store = torch.full((rz.numel() + 5,), float("nan"), device=device)              # z into a caller's buffer
    z_out = store[: rz.numel()].view(rz.shape)
    tt, tz = kmk.markov_sample_triton(*args, **tiles, one_launch=True, z_out=z_out)
    out["markov_sample_z_out"] = {"tokens_equal": bool(torch.equal(tt, rt)) and tz.data_ptr() == store.data_ptr(),
                                  "err": _err(tz, rz)}
    from dspark_trt.plugins.markov_sample.aot import markov_sample_aot         # the TensorRT entry's argument wiring
    U, anchor, w1, w2, temp, seed, start = args
    B, N, V = U.shape
    tt, tz = torch.empty_like(tt), torch.empty_like(tz)
    markov_sample_aot[(1,)](U, anchor, w1, w2, temp, seed, start, B, N, V, w1.shape[1], tt, tz,
                            BLOCK_B=16, BLOCK_V=64, BLOCK_R=16)
    out["markov_sample_aot"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    rt, rz = markov_sample_topk_ref(*args, 64, 2)
    tt, tz = kmt.markov_sample_topk_triton(*args, 64, 2)
    out["markov_sample_topk"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    args = markov_inputs(device, dtype, B=1, N=4)                 # gemv with one row: the 1-D body
    rt, rz = markov_sample_ref(*args)
    for name, pipe in (("gemv_b1", False), ("gemv_b1_pipeline", True)):
        tt, tz = kmk.markov_sample_triton(*args, one_launch=False, reduce="prologue", gemv=True, snake=True,
                                          num_programs=3, block_v=32, l2_keep=0.5, pipeline=pipe)
        out[f"markov_sample_{name}"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    args = markov_inputs(device, dtype, B=1, N=4)
    args = (*args[:4], torch.full((1,), 0.9, device=device), *args[5:])   # one sampled row: the Gumbel branch
    rt, rz = markov_sample_ref(*args)
    tt, tz = kmk.markov_sample_triton(*args, one_launch=True, gemv=True, snake=True, block_v=32)
    out["markov_sample_one_gemv_b1_sampled"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    args = markov_inputs(device, dtype, B=5, N=3)
    args = (*args[:4], torch.zeros(5, device=device), *args[5:])   # every row greedy: the group skips the noise
    rt, rz = markov_sample_ref(*args)
    for name, kw in (("all_greedy_one", dict(one_launch=True)), ("all_greedy_per_step", dict(one_launch=False))):
        tt, tz = kmk.markov_sample_triton(*args, **{**tiles, **kw})
        out[f"markov_sample_{name}"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    args = markov_inputs(device, dtype, B=70, N=2, V=200)       # two row groups of 64: one ticket each
    rt, rz = markov_sample_ref(*args)
    for name, kw in (("per_step_groups", {}), ("prologue_groups", dict(reduce="prologue", snake=True))):
        tt, tz = kmk.markov_sample_triton(*args, one_launch=False, num_programs=3, block_v=64, block_r=16, **kw)
        out[f"markov_sample_{name}"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    args = markov_inputs(device, dtype, B=6, N=4, V=1000, r=40)  # candidates span several bias tiles
    rt, rz = markov_sample_topk_ref(*args, 128, 3)
    tt, tz = kmt.markov_sample_topk_triton(*args, 128, 3)
    out["markov_sample_topk_wide"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}

    # a draft vocabulary (models/draft_vocab.py): U over 50 of 200 tokens, W1 as [50 + 200, r] (the set's
    # rows, then every token's) and the anchor's row past the set: kernels index W1 by more rows than U's
    U, anchor, w1, w2, *rest = markov_inputs(device, dtype, B=4, N=3, V=200)
    sub = (U[..., :50].contiguous(), torch.where(anchor >= 0, anchor + 50, anchor), torch.cat([w1[:50], w1]),
           w2[:50].contiguous(), *rest)
    rt, rz = markov_sample_ref(*sub)
    for name, kw in (("one", dict(one_launch=True)), ("per_step", dict(one_launch=False)),
                     ("gemv", dict(one_launch=True, gemv=True, snake=True, block_v=32))):
        tt, tz = kmk.markov_sample_triton(*sub, **{**tiles, **kw})
        out[f"markov_sample_draft_vocab_{name}"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}
    rt, rz = markov_sample_topk_ref(*sub, 16, 2)
    tt, tz = kmt.markov_sample_topk_triton(*sub, 16, 2)
    out["markov_sample_draft_vocab_topk"] = {"tokens_equal": bool(torch.equal(tt, rt)), "err": _err(tz, rz)}

    out["markov_packed_argmax"] = packed_argmax_case(device)


def _rejection_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import rejection as krj
    # split schedule: default launch, then several vocabulary chunks per row (partial last chunk)
    L, drafts, z, temp, seed, start = rejection_inputs(device, dtype)
    cases = {"rejection_sample": ((L, drafts, z, temp, seed, start), {}),
             "rejection_sample_row": ((L, drafts, z, temp, seed, start), {"schedule": "row"}),
             "rejection_sample_split": ((L, drafts, z, temp, seed, start),
                                        {"block_v": 16, "splits": 5, "res_splits": 4}),
             "rejection_sample_bonus_only": ((L[:, :1].contiguous(), drafts[:, :0], z[:, :0], temp, seed, start),
                                             {"block_v": 16, "splits": 6, "res_splits": 5}),
             "rejection_sample_many": (rejection_many_inputs(device), {"block_v": 16, "splits": 3, "res_splits": 5}),
             "rejection_sample_topp": (rejection_topp_inputs(device, dtype),
                                       {"block_v": 16, "splits": 6, "res_splits": 5}),
             "rejection_sample_topp_row": (rejection_topp_inputs(device, dtype), {"schedule": "row", "block_v": 64})}
    for name, (args, kw) in cases.items():
        ra, rn = rejection_sample_ref(*args)
        ta, tn = krj.rejection_sample_triton(*args, **kw)
        out[name] = {"tokens_equal": bool(torch.equal(ra, ta) and torch.equal(rn, tn)), "accepted": ra.tolist()}
    _sample_tokens_cases(device, out)
    _rows_finite_cases(device, out)


def _rows_finite_cases(device, out):
    """``kernels/finite.py`` against ``rows_finite_ref``: [B, W, V] logits (fp32 and bf16, V not a
    multiple of the tile) with a NaN, a +Inf and a -Inf each in one row, at a slice's first and
    last column, one slice per row or several."""
    from dspark_trt.plugins.finite import rows_finite_ref
    from dspark_trt.plugins.kernels.finite import BLOCK_V, rows_finite_triton
    V = 2 * BLOCK_V + 37
    x = torch.randn(5, 3, V, generator=torch.Generator().manual_seed(4)).to(device) * 30
    x[1, 2, V - 1] = float("nan")
    x[2, 0, 0] = float("inf")
    x[4, 1, BLOCK_V] = -float("inf")
    for name, t in (("fp32", x), ("bf16", x.to(torch.bfloat16))):
        for slices in (None, 1, 3):
            got = rows_finite_triton(t, slices=slices)
            out[f"rows_finite_{name}_{slices}"] = {"equal": bool(torch.equal(got, rows_finite_ref(t))),
                                                   "flags": got.tolist(), "bool": got.dtype == torch.bool}


def _sample_tokens_cases(device, out):
    """``kernels/sample.py`` against ``sample_tokens_ref``: greedy and sampled rows, one slice or
    several with a partial last one, bf16 logits, rows under a -inf prefix longer than a tile and
    a row of -inf only."""
    from dspark_trt.plugins.kernels.sample import sample_tokens_triton
    from dspark_trt.plugins.rejection_sample import sample_tokens_ref
    L, _, _, temp, seed, start = rejection_inputs(device)
    masked = rejection_topp_inputs(device)[0][:, 0].clone()
    masked[4] = float("-inf")
    cases = {"sample_tokens": ((L[:, 0], temp, seed, start), {}),
             "sample_tokens_split": ((L[:, 1], temp, seed, start + 1), {"block_v": 16, "slices": 5}),
             "sample_tokens_bf16": ((L[:, 2].to(torch.bfloat16), temp, seed + 7, start), {"block_v": 32, "slices": 3}),
             "sample_tokens_masked": ((masked, temp, seed, start), {"block_v": 16, "slices": 6})}
    for name, (args, kw) in cases.items():
        ref, got = sample_tokens_ref(*args), sample_tokens_triton(*args, **kw)
        out[name] = {"tokens_equal": bool(torch.equal(ref, got)), "tokens": ref.tolist(),
                     "argmax": args[0].argmax(-1).tolist(), "greedy": (args[1] <= 0).tolist()}


def _swa_and_mla_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import sparse_mla as ksm, swa_indices as ksw
    args = swa_inputs(device)
    ri, rl = noncausal_swa_indices_ref(*args)
    ti, tl_ = ksw.noncausal_swa_indices_triton(*args)
    out["noncausal_swa_indices"] = {"tokens_equal": bool(torch.equal(ri, ti) and torch.equal(rl, tl_))}

    cases = {"sparse_mla_attention": (sparse_mla_inputs(device, dtype), {}),
             # index list split in three (reduce with the sink), a token without valid entries
             "sparse_mla_attention_split": (sparse_mla_inputs(device, dtype), {"block_n": 16, "num_splits": 3}),
             # dv = D in two dv tiles, heads not a multiple of the head tile, split list
             "sparse_mla_attention_dv_tiles": (sparse_mla_inputs(device, dtype, H=24, dv=64),
                                               {"block_h": 16, "block_dv": 32, "block_n": 16, "num_splits": 2}),
             "sparse_mla_attention_dv_eq_d": (sparse_mla_inputs(device, dtype, dv=64), {"block_n": 16}),
             "sparse_mla_attention_padded": (sparse_mla_padded_inputs(device, dtype),
                                             {"block_n": 16, "num_splits": 1}),
             "sparse_mla_attention_padded_split": (sparse_mla_padded_inputs(device, dtype),
                                                   {"block_n": 16, "num_splits": 4}),
             # the default loads a tile's indices one iteration ahead; without it, in the iteration
             "sparse_mla_attention_no_prefetch": (sparse_mla_padded_inputs(device, dtype),
                                                  {"block_n": 16, "num_splits": 1, "prefetch": False}),
             "sparse_mla_attention_no_prefetch_split": (sparse_mla_inputs(device, dtype),
                                                        {"block_n": 16, "num_splits": 3, "prefetch": False}),
             # G tokens of equal lists per program: 2 x 16 heads, and 4 x 16 of 24 heads (a masked tile)
             "sparse_mla_attention_group2": (sparse_mla_group_inputs(device, dtype), {"block_n": 16, "group": 2}),
             "sparse_mla_attention_group4_masked_heads": (sparse_mla_group_inputs(device, dtype, G=4, H=24),
                                                          {"block_h": 16, "block_n": 16, "group": 4})}
    for name, (args, kw) in cases.items():
        out[name] = {"err": _err(ksm.sparse_mla_attention_triton(*args, **kw), sparse_mla_attention_ref(*args))}


def _moe_cases(device, dtype, out):
    from dspark_trt.plugins.kernels import moe as kmoe
    cases = {"moe_experts": (moe_inputs(device, dtype), {"schedule": "grouped"}),
             # the GEMV schedule: the op's choice at these sizes; tiles not dividing d / h, no clamp
             "moe_experts_decode": (moe_inputs(device, dtype), {}),
             "moe_experts_decode_tiles": (moe_inputs(device, dtype, M=5, k=2, E=3, d=40, h=24, first_expert=0,
                                                     limit=0.0), {"schedule": "decode", "block_n": 16,
                                                                  "block_k": 32, "num_warps": 2}),
             # the K loop pipelined three tiles deep (k_stages), a partial last chunk
             "moe_experts_decode_stages": (moe_inputs(device, dtype, M=5, k=2, E=3, d=40, h=24, first_expert=0),
                                           {"schedule": "decode", "block_k": 16, "k_stages": 3}),
             # several blocks per expert (k=2 over 40 tokens), tiles not dividing d / h, no clamp
             "moe_experts_blocks": (moe_inputs(device, dtype, M=40, k=2, E=3, d=40, h=24, first_expert=0, limit=0.0),
                                    {"block_n": 16, "block_k": 16}),
             "moe_experts_int32_ids": (tuple(a.int() if i == 1 else a for i, a in enumerate(moe_inputs(device, dtype))),
                                       {"block_m": 32})}
    for name, (args, kw) in cases.items():
        out[name] = {"err": _err(kmoe.moe_experts_triton(*args, **kw), moe_experts_ref(*args))}
    from dspark_trt.plugins.moe_experts.aot import moe_experts_aot          # the TensorRT entry (token schedule)
    x, ids, w, w13, w2, first, limit = args = moe_inputs(device, dtype)
    y = torch.empty_like(x)
    moe_experts_aot[(x.shape[0], 2)](x, ids, w, w13, w2, first, w13.shape[0], x.shape[1], w2.shape[2], ids.shape[1],
                                     y, LIMIT=limit, BLOCK_D=32, BLOCK_H=16, BLOCK_K=32)
    out["moe_experts_aot"] = {"err": _err(y, moe_experts_ref(*args))}


def _tuner_cases(*ops):
    def cases(device, dtype, out):
        r = tuner_configs(device, dtype, ops)
        prev = out.setdefault("tuner_configs", {"checked": 0, "distinct": 0, "failures": []})
        for k in prev:
            prev[k] += r[k]
    return cases


# run_all's cases in sections, so that a caller can spread them over processes (the interpreter
# runs programs one after another: tests/plugins/test_plugins_triton_interpret.py runs two halves)
SECTIONS = {"kv_cache": _kv_cache_cases, "block_attention": _block_attention_cases, "markov": _markov_cases,
            "rejection": _rejection_cases, "swa_and_mla": _swa_and_mla_cases, "moe": _moe_cases,
            "tuner_rejection": _tuner_cases("rejection"), "tuner_markov": _tuner_cases("markov"),
            "tuner_block_attention": _tuner_cases("block_attention"),
            "tuner_sparse_mla": _tuner_cases("sparse_mla")}


def run_all(device, dtype=torch.float32, sections=None) -> dict:
    """Every kernel launcher against its reference (or the named ``SECTIONS``); returns
    {case: {metric: value}}; "tuner_configs" sums the tuner sections run."""
    out = {}
    for name in SECTIONS if sections is None else sections:
        SECTIONS[name](device, dtype, out)
    return out


def moe_mxfp4_cases(device) -> dict:
    """dspark::moe_experts_mxfp4's kernels vs its reference (fp32 x): grouped (tiles not dividing
    d / h, several blocks per expert, int8 packing, no clamp, EP offset 0), the AOT token entry;
    bf16 x through ``tl.dot_scaled``: {"err", "err16"} against the fp32 reference (err16: the bf16
    reference's). -> {case: {"err": max abs error, "scale": max |reference|}}."""
    from dspark_trt.plugins.kernels import moe as kmoe
    from dspark_trt.plugins.moe_experts_mxfp4 import moe_experts_mxfp4_ref
    from dspark_trt.plugins.moe_experts_mxfp4.aot import moe_experts_mxfp4_aot
    base = moe_mxfp4_inputs(device)
    int8 = tuple(a.view(torch.int8) if i in (3, 5) else a for i, a in enumerate(base))
    cases = {"moe_mxfp4": (base, {"schedule": "grouped"}),
             "moe_mxfp4_decode": (base, {}),
             # d, h not multiples of block_k (several chunks, the last one partial), no clamp, EP offset 0
             "moe_mxfp4_decode_tiles": (moe_mxfp4_inputs(device, M=5, k=2, E=3, d=96, h=64, first_expert=0,
                                                         limit=0.0), {"schedule": "decode", "block_n": 8,
                                                                      "block_k": 64, "num_warps": 2}),
             "moe_mxfp4_decode_stages": (moe_mxfp4_inputs(device, M=5, k=2, E=3, d=96, h=64, first_expert=0),
                                         {"schedule": "decode", "block_n": 8, "block_k": 32, "k_stages": 3}),
             # 27 pairs: the default decode tile is DECODE_WIDE (32 x 256, d below one chunk: masked)
             "moe_mxfp4_decode_wide": (moe_mxfp4_inputs(device, M=9, k=3, E=5, d=96, h=64, first_expert=0),
                                       {"schedule": "decode"}),
             "moe_mxfp4_tiles": (base, {"block_n": 16, "block_k": 32}),
             "moe_mxfp4_blocks": (moe_mxfp4_inputs(device, M=40, k=2, E=3, d=96, h=64, first_expert=0, limit=0.0),
                                  {"block_n": 32, "block_k": 64}),
             "moe_mxfp4_int8": (int8, {"block_m": 32})}
    out = {}
    for name, (args, kw) in cases.items():
        ref = moe_experts_mxfp4_ref(*args)
        out[name] = {"err": _err(kmoe.moe_experts_mxfp4_triton(*args, **kw), ref), "scale": float(ref.abs().max())}
    x, ids, w, w13p, w13s, w2p, w2s, first, limit = base
    y = torch.empty_like(x)
    moe_experts_mxfp4_aot[(x.shape[0], 2)](x, ids, w, w13p, w13s, w2p, w2s, first, w13p.shape[0], x.shape[1],
                                           2 * w2p.shape[2], ids.shape[1], y, LIMIT=limit, BLOCK_D=32, BLOCK_H=32,
                                           BLOCK_K=32)
    ref = moe_experts_mxfp4_ref(*base)
    out["moe_mxfp4_aot"] = {"err": _err(y, ref), "scale": float(ref.abs().max())}
    b16 = (x.bfloat16(), *base[1:])
    got = kmoe.moe_experts_mxfp4_triton(*b16, dot_scaled=True, block_k=32)
    out["moe_mxfp4_dot_scaled"] = {"err": _err(got, ref), "err16": _err(moe_experts_mxfp4_ref(*b16), ref),
                                   "scale": float(ref.abs().max())}
    got = kmoe.moe_experts_mxfp4_triton(*b16, schedule="decode")
    out["moe_mxfp4_decode_bf16"] = {"err": _err(got, ref), "err16": _err(moe_experts_mxfp4_ref(*b16), ref),
                                    "scale": float(ref.abs().max())}
    for decode in ("bytes", "e4m3"):
        out[f"moe_mxfp4_decode_{decode}"] = {"err": _err(kmoe.moe_experts_mxfp4_triton(*base, decode=decode), ref),
                                             "scale": float(ref.abs().max())}
    from tests.support.mxfp4_codes import every_code_case
    for decode in ("words", "bytes", "e4m3"):
        out[f"mxfp4_codes_{decode}"] = every_code_case(device, decode)
    return out


def distinct(configs: list[dict]) -> list[dict]:
    """``configs`` without repeats (the tuner's lists share entries: on one input a repeat runs the same)."""
    import json
    seen = {}
    for cfg in configs:
        seen.setdefault(json.dumps(cfg, sort_keys=True), cfg)
    return list(seen.values())


def one_grid_override(configs: list[dict]) -> list[dict]:
    """Markov configs that differ only in ``num_programs`` (the old per-step grid rule at the tuner's
    vocabularies: 594, 1010 programs) keep the first. On ``markov_inputs`` (V=300: 3 tiles of 128,
    B=3: partials reduced 256 a chunk) both values give the same code path: programs beyond the 3rd
    get no tile, the partials take several chunks, the last one partial. The interpreter runs the
    programs one after another (70 s for 594 programs, 2 min for 1010); the GPU runs them all."""
    import json
    seen, kept = set(), []
    for cfg in configs:
        if "num_programs" in cfg:
            assert cfg["num_programs"] > 2 * 256, cfg           # the case made for these grids
            key = json.dumps({k: v for k, v in cfg.items() if k != "num_programs"}, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
        kept.append(cfg)
    return kept


TUNER_OPS = ("rejection", "markov", "block_attention", "sparse_mla")


def tuner_configs(device, dtype=torch.float32, ops=TUNER_OPS) -> dict:
    """Every candidate config of benchmarks/tune_plugins.py (of ``ops``) on the small inputs: the
    launchers accept it and match the reference (tokens exact, floats within 1e-5). The tuner runs
    each op's lists on several shapes, and some configs are in more than one list: here every input
    is one small case per op, so each distinct config runs once. -> {"checked", "distinct", "failures"}."""
    from benchmarks import tune_plugins as tp
    from dspark_trt.plugins.kernels import block_attention as kba, markov_launch as kmk
    from dspark_trt.plugins.kernels import rejection as krj, sparse_mla as ksm
    failures, checked = [], 0
    lists = {"rejection": distinct(tp.REJECTION_CONFIGS),
             "markov": distinct(tp.MARKOV_B1 + tp.MARKOV_B64 + tp.MARKOV_R512),
             "block_attention": distinct(tp.ATTN_CONFIGS + tp.ATTN_B1), "sparse_mla": distinct(tp.MLA_CONFIGS)}

    if torch.device(device).type == "cpu":                   # the interpreter: see one_grid_override
        lists["markov"] = one_grid_override(lists["markov"])

    def check(name, cfg, ok):
        nonlocal checked
        checked += 1
        if not ok:
            failures.append(f"{name} {cfg}")

    if "rejection" in ops:
        args = rejection_inputs(device, dtype)
        ra, rn = rejection_sample_ref(*args)
        for cfg in lists["rejection"]:
            a, n = krj.rejection_sample_triton(*args, **cfg)
            check("rejection", cfg, torch.equal(a, ra) and torch.equal(n, rn))
    if "markov" in ops:
        args = markov_inputs(device, dtype)
        rt, rz = markov_sample_ref(*args)
        for cfg in lists["markov"]:
            t, z = kmk.markov_sample_triton(*args, **cfg)
            check("markov", cfg, torch.equal(t, rt) and _err(z, rz) < 1e-5)
    if "block_attention" in ops:
        q, kc, vc, table, pos, causal, block, scale = block_attention_inputs(device, dtype)
        ref = block_attention_ref(q, kc, vc, table, pos, block, scale)
        for cfg in lists["block_attention"]:
            check("block_attention", cfg, _err(kba.block_attention_triton(q, kc, vc, table, pos, block, scale,
                                                                          **cfg), ref) < 1e-5)
    if "sparse_mla" in ops:
        args = sparse_mla_group_inputs(device, dtype, G=8)        # lists shared by 8 tokens: any group
        ref = sparse_mla_attention_ref(*args)
        for cfg in lists["sparse_mla"]:
            check("sparse_mla", cfg, _err(ksm.sparse_mla_attention_triton(*args, **cfg), ref) < 1e-5)
    return {"checked": checked, "distinct": sum(len(lists[op]) for op in ops), "failures": failures}


def write_results(out, sections) -> None:
    """run_all of ``sections`` on the CPU into ``out``/results.json (a background job of the
    interpreter tests, tests/support/prebuilt.py, with TRITON_INTERPRET=1)."""
    import json
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1", "the interpreter cases need TRITON_INTERPRET=1"
    (out / "results.json").write_text(json.dumps(run_all("cpu", sections=sections)))


if __name__ == "__main__":       # python -m tests.support.plugins_cases [moe_mxfp4 | SECTION,...] (TRITON_INTERPRET=1)
    import json
    import sys
    if sys.argv[1:] == ["moe_mxfp4"]:
        out = moe_mxfp4_cases("cpu")
    else:
        out = run_all("cpu", sections=sys.argv[1].split(",") if len(sys.argv) > 1 else None)   # default: all
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
