"""Launch-configuration rules of the Triton ops (pure Python, an H200's 132 SMs assumed)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

from dspark_trt.plugins.kernels import block_attention as kba, markov_exact as kme, markov_launch as kmk  # noqa: E402
from dspark_trt.plugins.kernels import rejection as krj, sparse_mla as ksm  # noqa: E402
from tests.support.cond_graphs import cond_leaf_args  # noqa: E402

SMS = 132
DEV = torch.device("cpu")


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    for mod in (kba, kmk, krj, ksm):
        monkeypatch.setattr(mod, "num_sms", lambda device: SMS)


@pytest.mark.parametrize("B", [1, 8, 64, 256])
@pytest.mark.parametrize("V", [151936, 129280, 1000])
def test_rejection_chunks_cover_the_vocabulary(B, V):
    N = 7
    cfg = krj.rejection_config(B, N, V, DEV)
    for key in ("chunk_tiles", "res_chunk_tiles"):
        chunk = cfg[key] * cfg["block_v"]
        S = triton.cdiv(V, chunk)
        assert (S - 1) * chunk < V <= S * chunk              # no empty chunk, nothing left out
        assert 1 <= cfg[key] <= krj.REJECTION_DEFAULTS["max_tiles"]
    if B == 1 and V > 100000:                                # batch 1 spreads over the whole GPU
        S = triton.cdiv(V, cfg["chunk_tiles"] * cfg["block_v"])
        assert (2 * N + 1) * S >= 4 * SMS


def test_rejection_explicit_splits_and_bad_schedule():
    cfg = krj.rejection_config(1, 3, 200, DEV, block_v=16, splits=5, res_splits=4)
    assert triton.cdiv(200, cfg["chunk_tiles"] * 16) == 5 and triton.cdiv(200, cfg["res_chunk_tiles"] * 16) == 4
    z = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="schedule"):
        krj.rejection_sample_triton(z, torch.zeros(1, 1, dtype=torch.long), z[:, :1], torch.zeros(1),
                                    torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                    schedule="rows")


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("B,V,R", [(1, 151936, 256), (1, 129280, 512), (64, 151936, 256)])
def test_markov_per_step_grid_is_one_wave_of_whole_tiles(B, V, R, gemv):
    cfg = kmk.markov_config(B, V, R, DEV, one_launch=False, gemv=gemv)
    n_tiles = triton.cdiv(V, cfg["block_v"])
    per_program = triton.cdiv(n_tiles, cfg["C"])
    assert cfg["C"] <= cfg["programs_per_sm"] * SMS                   # fits the targeted residency
    assert (cfg["C"] - 1) * per_program < n_tiles <= cfg["C"] * per_program
    assert cfg["gemv"] == (gemv and B <= kmk.GEMV_MAX_B)
    if cfg["gemv"]:
        assert cfg["block_b"] == triton.next_power_of_2(B) and cfg["block_r"] >= R
        assert cfg["block_v"] * cfg["block_r"] == kmk.GEMV_TILE_ELEMS or cfg["block_v"] == 16


def test_markov_small_batch_overrides(monkeypatch):
    monkeypatch.setattr(kmk, "MARKOV_SMALL_B", {"gemv": True, "reduce": "prologue"})
    monkeypatch.setattr(kmk, "MARKOV_B1", {})
    small = kmk.markov_config(1, 151936, 256, DEV)
    assert small["gemv"] and small["reduce"] == "prologue" and small["block_v"] == kmk.GEMV_TILE_ELEMS // 256
    big = kmk.markov_config(64, 151936, 256, DEV)
    assert not big["gemv"] and big["reduce"] == kmk.MARKOV_DEFAULTS["reduce"]
    assert kmk.markov_config(1, 151936, 256, DEV, reduce="ticket")["reduce"] == "ticket"   # explicit wins


def test_markov_batch1_schedule_applies_only_when_not_chosen():
    b1 = kmk.markov_config(1, 151936, 256, DEV)
    assert {k: b1[k] for k in kmk.MARKOV_B1} == kmk.MARKOV_B1
    assert b1["C"] == kmk.MARKOV_B1["resident_per_sm"] * SMS
    b2 = kmk.markov_config(2, 151936, 256, DEV)                    # batches 2..4: not timed with it
    assert not b2["one_launch"] and b2["reduce"] == kmk.MARKOV_SMALL_B["reduce"]
    for chosen in (dict(one_launch=False), dict(gemv=False)):      # a schedule the caller picks stays whole
        cfg = kmk.markov_config(1, 151936, 256, DEV, **chosen)
        assert not cfg["one_launch"] and cfg["block_v"] != kmk.MARKOV_B1["block_v"]


@pytest.mark.parametrize("B", [2, 16, 31, 32, 64, 65])
def test_markov_one_launch_for_the_measured_large_batches(B):
    lo, hi = kmk.ONE_LAUNCH_B
    assert kmk.markov_config(B, 151936, 256, DEV)["one_launch"] == (lo <= B <= hi)
    assert not kmk.markov_config(B, 151936, 256, DEV, one_launch=False)["one_launch"]   # the caller's choice
    block_r = kmk.markov_config(B, 151936, 256, DEV)["block_r"]                  # rank-128 tiles over 32 rows
    assert block_r == (128 if 32 < B <= hi else kmk.MARKOV_DEFAULTS["block_r"]), block_r
    assert kmk.markov_config(B, 151936, 256, DEV, block_r=32)["block_r"] == 32


def test_markov_batch1_pipelines_small_tiles_only():
    """Two 16 KB tiles in flight (r=512) cost a program per SM, measured slower: no pipeline
    there unless asked for."""
    assert kmk.markov_config(1, 151936, 256, DEV)["pipeline"] == kmk.MARKOV_B1["pipeline"]
    assert not kmk.markov_config(1, 129280, 512, DEV)["pipeline"]
    assert kmk.markov_config(1, 129280, 512, DEV, pipeline=True)["pipeline"]


def test_one_launch_grid_fits_the_sms():
    from types import SimpleNamespace as NS
    from dspark_trt.plugins.kernels.common import max_resident_programs
    props = NS(max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
               shared_memory_per_multiprocessor=233472)
    kernel = lambda regs, warps, shared: NS(n_regs=regs, metadata=NS(num_warps=warps, shared=shared))  # noqa: E731
    assert max_resident_programs(kernel(64, 4, 0), None, props) == 8          # registers: 65536 / (64 * 128)
    assert max_resident_programs(kernel(32, 4, 0), None, props) == 16         # warps: 64 / 4
    assert max_resident_programs(kernel(40, 1, 0), None, props) == 32         # blocks per SM
    assert max_resident_programs(kernel(32, 4, 100_000), None, props) == 2    # shared memory
    assert max_resident_programs(kernel(33, 8, 0), None, props) == 6          # 33 regs -> 40 per thread
    assert kmk.resident_grid(6 * 132, 1, 5, 132) == 5 * 132
    assert kmk.resident_grid(100, 2, 5, 132) == 100                            # already fits
    with pytest.raises(RuntimeError, match="cannot all be resident"):
        kmk.resident_grid(1, 700, 5, 132)


def test_resident_c_checks_the_grid_it_launches(monkeypatch):
    """The fit is taken from the kernel compiled for the C that will launch (Triton specialises C
    on divisibility by 16), and cached per variant."""
    from types import SimpleNamespace as NS
    compiled_for = []

    def warmup(*args, grid, **meta):
        C = args[17]                          # after 13 tensors and B, N, V, R (markov_sample_kernel)
        assert grid[0] == C
        compiled_for.append(C)
        return NS(divisible=C % 16 == 0)
    monkeypatch.setattr(kme.markov_sample_kernel, "warmup", warmup)
    monkeypatch.setattr(kmk, "max_resident_programs", lambda k, dev: 5 if k.divisible else 4)
    monkeypatch.setattr(kmk, "num_sms", lambda dev: 132)
    monkeypatch.setattr(kmk, "_FIT_CACHE", {})
    t = torch.zeros(1)
    head = (t,) * 13 + (1, 7, 151936, 256)
    meta = dict(BLOCK_B=1, GRID_SYNC=True)
    assert kmk._resident_c(head, 792, 1, torch.device("cpu"), 7, (0, 0, 0), meta) == 528   # 792: 4 fit -> 528: 5 fit
    assert compiled_for == [792, 528]
    assert kmk._resident_c(head, 792, 1, torch.device("cpu"), 7, (0, 0, 0), meta) == 528
    assert compiled_for == [792, 528]                                   # cached
    one_step = (t,) * 13 + (1, 1, 151936, 256)                          # N = 1: Triton specialises it
    assert kmk._resident_c(one_step, 792, 1, torch.device("cpu"), 1, (0, 0, 0), meta) == 528
    assert compiled_for == [792, 528, 792, 528]                         # its own kernels, its own fit


def test_markov_one_launch_is_resident_and_bad_reduce_raises():
    assert kmk.markov_config(1, 151936, 256, DEV, one_launch=True, resident_per_sm=1)["C"] == SMS
    assert kmk.markov_config(100, 151936, 256, DEV, one_launch=True)["C"] == SMS // 2   # two row groups
    assert kmk.markov_config(1, 151936, 256, DEV, one_launch=True, resident_per_sm=6)["C"] == 6 * SMS
    with pytest.raises(ValueError, match="reduce"):
        kmk.markov_config(1, 1000, 16, DEV, one_launch=False, reduce="atomic")


@pytest.mark.parametrize("programs", [8, 100, 512, 777, 4096])
def test_attention_splits_fill_waves(programs):
    pps = kba.ATTN_DEFAULTS["programs_per_sm"]
    slots = pps * SMS
    S = kba.default_num_splits(DEV, programs, 4104, 64, pps)
    if programs < slots:                        # below a wave: the most splits that stay within one
        assert S == min(slots // programs, triton.cdiv(4104, 64))
        assert programs * S <= slots and (programs * (S + 1) > slots or S == triton.cdiv(4104, 64))
        return
    fill = lambda s: programs * s / (triton.cdiv(programs * s, slots) * slots)
    assert fill(S) >= 0.9 or fill(S) == max(fill(s) for s in range(1, 9))
    assert all(fill(s) < 0.9 for s in range(1, S))          # the fewest splits that reach 90 %


def test_attention_splits_env_overrides_the_default_and_names_a_bad_value(monkeypatch):
    """``DSPARK_ATTN_SPLITS`` fixes the split count of every shape-static launch (the split kernel's
    grid: S programs per (KV head, row, query tile)); a bad value is an error naming the variable."""
    from tests.support.plugins_cases import block_attention_inputs
    q, kc, vc, table, pos, _, block, scale = block_attention_inputs("cpu", torch.float32, H=8, Hkv=2, D=16, page=16)
    grids = []

    class Grid:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **k: grids.append((self.kernel.__name__, tuple(grid)))

    monkeypatch.setattr(kba, "launcher", Grid)
    monkeypatch.setenv(kba.SPLITS_ENV, "3")
    kba.block_attention_triton(q, kc, vc, table, pos, block, scale)
    B = q.shape[0]
    assert grids[0] == ("block_attention_split_kernel", (2, B, 3))      # (Hkv, B, one query tile of T = 4) x 3
    assert kba.env_num_splits() == 3
    monkeypatch.setenv(kba.SPLITS_ENV, "1")
    kba.block_attention_triton(q, kc, vc, table, pos, block, scale)
    assert grids[-1][0] == "block_attention_kernel"                                  # one split: no reduce
    monkeypatch.setenv(kba.SPLITS_ENV, " ")
    assert kba.env_num_splits() is None
    for bad in ("0", "two", "-2"):
        monkeypatch.setenv(kba.SPLITS_ENV, bad)
        with pytest.raises(ValueError, match="DSPARK_ATTN_SPLITS"):
            kba.block_attention_triton(q, kc, vc, table, pos, block, scale)


def test_mla_splits_only_for_few_tokens():
    """Lists are split only while even 16-head tiles leave fewer than a quarter wave of programs
    (1..4 tokens of 128 heads); from one batch row of 8 tokens they are walked whole (H100: 16 heads
    whole 10.1 us against 14.6 for 64 heads split, 19.2 against 45.9 at 8 rows)."""
    for T in (8, 16, 64, 512):
        assert ksm.mla_config(T, 128, 512, 512, 256, DEV)["num_splits"] == 1, T
    one = ksm.mla_config(1, 128, 512, 512, 256, DEV)        # 8 programs of 16 heads
    assert one["block_h"] == 16 and one["num_splits"] == 4 and one["num_warps"] == 8
    assert (one["num_splits"] - 1) * one["chunk"] < 256 <= one["num_splits"] * one["chunk"]
    assert ksm.mla_config(4, 128, 512, 512, 256, DEV)["num_splits"] == 2           # 32 programs
    assert ksm.mla_config(8, 128, 512, 512, 256, DEV, block_h=64)["num_splits"] == 2   # 16 programs, 128-entry chunks
    assert ksm.mla_config(8, 16, 64, 32, 24, DEV)["block_dv"] == 32        # never wider than dv
    with pytest.raises(ValueError, match="block_dv"):
        ksm.mla_config(8, 128, 512, 512, 256, DEV, block_dv=96)
    # G tokens a program walk whole lists: no split, even where few tokens would split them
    assert ksm.mla_config(8, 128, 512, 512, 256, DEV, group=2)["num_splits"] == 1
    for bad in ({"group": 3}, {"group": 16}, {"group": 2, "num_splits": 4}):     # 16 does not divide 8 tokens
        with pytest.raises(ValueError, match="group"):
            ksm.mla_config(8, 128, 512, 512, 256, DEV, **bad)
    with pytest.raises(ValueError, match="static token count"):                # T traced symbolically
        ksm.mla_config(object(), 128, 512, 512, 256, DEV, group=2)


def test_mla_defaults_are_64_row_wgmma_tiles_with_8_warps():
    """The default: 64 heads x all 512 value dims, 64-entry tiles, 8 warps (a 64-row MMA, Hopper's
    wgmma), from 8 rows of 8 tokens (128 programs); up to 4 rows 16 heads and 4 warps (64-head tiles
    would leave more than half the SMs idle); 32-row tiles (the earlier default) keep 4 warps for
    whole lists and 8 for split ones; an export (symbolic T) takes the wide tiles."""
    for T in (64, 512):
        cfg = ksm.mla_config(T, 128, 512, 512, 256, DEV)
        assert (cfg["block_h"], cfg["block_dv"], cfg["block_n"], cfg["num_warps"], cfg["num_splits"]) == \
            (64, 512, 64, 8, 1), T
    for T in (8, 16, 32):
        cfg = ksm.mla_config(T, 128, 512, 512, 256, DEV)
        assert (cfg["block_h"], cfg["block_n"], cfg["num_warps"], cfg["num_splits"]) == (16, 64, 4, 1), T
    assert ksm.mla_config(object(), 128, 512, 512, 256, DEV)["block_h"] == 64
    assert ksm.mla_config(512, 128, 512, 512, 256, DEV, block_h=32)["num_warps"] == 4
    assert ksm.mla_config(512, 128, 512, 512, 256, DEV, block_h=32, group=2)["num_warps"] == 8   # 64 rows
    assert ksm.mla_config(8, 128, 512, 512, 256, DEV, block_h=32)["num_warps"] == 8            # split
    assert ksm.mla_config(8, 4, 32, 32, 24, DEV)["num_warps"] == 4          # 4 heads: 16-row tiles


def _export_with_launches_recorded(monkeypatch, op: str, kernels, module, args, dims):
    """torch.export of ``module`` (calling ``dspark::<op>``) as an engine's build on a GPU sees it:
    the device check forced, the op kept, the Triton launches of ``kernels`` recorded (fake tensors:
    nothing runs). Returns (program, launches)."""
    import sys
    from dspark_trt.builder.export import ReferenceOps
    from tests.plugins.test_plugins_compile import _Recorder
    launches = []
    with monkeypatch.context() as m:
        m.setattr(sys.modules[f"dspark_trt.plugins.{op}"], "use_triton", lambda x: True)
        m.setattr(kernels, "launcher", _Recorder(launches))
        with torch.no_grad(), ReferenceOps({f"dspark::{op}"}) as kept:
            ep = torch.export.export(module, args, dynamic_shapes=dims, strict=False)
    assert kept.kept == {f"dspark::{op}"} and len(ep.range_constraints) == 2     # both sizes stay dynamic
    return ep, launches


def _mla_cond_tiles(gm) -> list[int]:
    """``block_h`` of the dspark::sparse_mla_attention calls under torch.cond, true branch first."""
    return cond_leaf_args(gm, (torch.ops.dspark.sparse_mla_attention.default,), 6)


def test_mla_export_with_dynamic_tokens_and_width_walks_whole_lists(monkeypatch):
    """An engine's export (token count and index-list width dynamic, as the V4 networks' widths
    follow pages_per_seq) through ``sparse_mla_attention_bucketed``, as the V4 attention calls it:
    no guard on either size (before, the split and scan tiles were sized from W: a constraint
    violation, so engines ran the reference); a torch.cond on the token count (<= the few-token
    limit, 32 tokens of 128 heads on 132 SMs) calls the op with 16-head tiles, else 64; both walk
    whole lists, the scan MAX_SCAN entries a load. The program equals the
    reference on both sides of the limit (run on the CPU)."""
    from torch.export import Dim
    from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_bucketed, sparse_mla_attention_ref
    from tests.support.plugins_cases import sparse_mla_inputs

    class Attend(torch.nn.Module):
        def forward(self, q, kv, idx, sink):
            return sparse_mla_attention_bucketed(q, kv, idx, sink, 0.125, 32)

    q, kv, idx, sink, _, _ = sparse_mla_inputs("cpu", T=3, H=128, D=64, dv=32, W=24)
    T, W = Dim("tokens", min=1, max=4096), Dim("width", min=1, max=8192)
    ep, launches = _export_with_launches_recorded(monkeypatch, "sparse_mla_attention", ksm, Attend(),
                                                  (q, kv, idx, sink), ({0: T}, None, {0: T, 1: W}, None))
    assert ksm.narrow_token_limit(128, 32, DEV) == 32
    assert _mla_cond_tiles(ep.graph_module) == [ksm.NARROW_BLOCK_H, ksm.WIDE_BLOCK_H]
    # each branch traced (several times): whole lists only, no split or reduce launch
    assert {(k.__name__, kw["BLOCK_H"], kw["BLOCK_SCAN"]) for k, _, kw in launches} == {
        ("sparse_mla_attention_kernel", 16, ksm.MAX_SCAN), ("sparse_mla_attention_kernel", 64, ksm.MAX_SCAN)}
    for t, w in ((3, 5), (7, 24), (32, 40), (33, 40), (70, 300)):
        args = sparse_mla_inputs("cpu", T=t, H=128, D=64, dv=32, W=w)[:4]
        assert torch.equal(ep.module()(*args), sparse_mla_attention_ref(*args, 0.125, 32)), (t, w)
    with pytest.raises(ValueError, match="whole index lists"):
        ksm.mla_config(object(), 128, 512, 512, 256, DEV, num_splits=2)


def test_mla_bucketed_concrete_tokens_call_the_op_once(monkeypatch):
    """Eager calls (a concrete token count) go straight to the op, whose launcher picks the tile:
    no torch.cond in a CUDA-graph capture or an eager step; the 128-head V4 shapes pick 16 heads up
    to 32 tokens on 132 SMs."""
    import sys
    from dspark_trt.plugins.sparse_mla_attention import sparse_mla_attention_bucketed
    from tests.plugins.test_plugins_compile import _Recorder
    from tests.support.plugins_cases import sparse_mla_inputs
    assert ksm.narrow_token_limit(128, 512, DEV) == 32
    launches = []
    monkeypatch.setattr(sys.modules["dspark_trt.plugins.sparse_mla_attention"], "use_triton", lambda x: True)
    monkeypatch.setattr(ksm, "launcher", _Recorder(launches))
    for T in (32, 33):
        q, kv, idx, sink, scale, dv = sparse_mla_inputs("cpu", torch.bfloat16, T=T, H=128, D=512, dv=512, S=300, W=256)
        sparse_mla_attention_bucketed(q, kv, idx, sink, scale, dv)
    assert [kw["BLOCK_H"] for _, _, kw in launches] == [16, 64]


def test_swa_indices_export_with_dynamic_batch_and_pages(monkeypatch):
    """The draft block's index lists in an engine: batch and block-table width (pages_per_seq)
    dynamic, one launch per batch row, no guard on either; equal to the reference at other sizes."""
    from torch.export import Dim
    from dspark_trt.plugins.kernels import swa_indices as ksw
    from dspark_trt.plugins.noncausal_swa_indices import noncausal_swa_indices_ref

    class Lists(torch.nn.Module):
        def forward(self, start, table):
            return torch.ops.dspark.noncausal_swa_indices(start, table, 5, 16, 64, 128)

    B, P = Dim("batch", min=1, max=64), Dim("pages", min=1, max=4096)
    ep, launches = _export_with_launches_recorded(monkeypatch, "noncausal_swa_indices", ksw, Lists(),
                                                  (torch.tensor([10, 100, -1]), torch.arange(60).view(3, 20)),
                                                  ({0: B}, {0: B, 1: P}))
    assert [k.__name__ for k, _, _ in launches] == ["noncausal_swa_indices_kernel"]
    for start, pages in (([7], 3), ([0, 300, -1, 45, 2], 40)):
        start = torch.tensor(start)
        table = torch.randperm(len(start) * pages).view(len(start), pages)
        got, want = ep.module()(start, table), noncausal_swa_indices_ref(start, table, 5, 16, 64, 128)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (start, pages)


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided"])
def test_markov_z_out_is_checked_before_any_launch(bad):
    """``z_out`` (the confidence rounds' shared z store) must be a contiguous fp32 [B, N, V]."""
    U = torch.zeros(2, 3, 40)
    z_out = {"shape": torch.zeros(2, 4, 40), "dtype": torch.zeros(2, 3, 40, dtype=torch.float64),
             "strided": torch.zeros(2, 40, 3).transpose(1, 2)}[bad]
    args = (U, torch.tensor([1, 2]), torch.zeros(40, 4), torch.zeros(40, 4), torch.zeros(2),
            torch.tensor([1, 2]), torch.tensor([5, 6]))
    with pytest.raises(ValueError, match=r"z_out must be a contiguous float32 \(2, 3, 40\) tensor"):
        kmk.markov_sample_triton(*args, z_out=z_out)
