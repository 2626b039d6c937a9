"""``grouped_block_attention``: the packed verify's slots attended grouped by their batch rows
(``runtime/packed_verify.py``), against ``block_attention_ref`` over the rectangular window. The
kernel's indexed launches run through the interpreter in ``test_plugins_triton_interpret.py``."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.plugins.block_attention import block_attention_ref, grouped_block_attention
from dspark_trt.runtime.packed_verify import slot_groups


def _window(B, W, H, Hkv, D, page, ctx, lengths, device, dtype, seed=0):
    """Random caches, window queries [B, W, H, D] at positions ctx .. ctx + W - 1 and the packed
    slots of each row's first ``lengths[r]`` queries (rows end to end, then 3 pad slots)."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-(ctx + W) // page)
    table = torch.randperm(B * pages, device=device, generator=g).view(B, pages)
    kc = torch.randn(B * pages + 1, page, Hkv, D, device=device, dtype=dtype, generator=g)
    vc = torch.randn(kc.shape, device=device, dtype=dtype, generator=g)
    q = torch.randn(B, W, H, D, device=device, dtype=dtype, generator=g)
    pos = (ctx + torch.arange(W, device=device)).expand(B, W).contiguous()
    groups = slot_groups(lengths, pos, table)
    live = groups.q_index >= 0
    packed = torch.randn(int(lengths.sum()) + 3, 1, H, D, device=device, dtype=dtype, generator=g)
    packed[groups.q_index[live].long(), 0] = q[live]
    return q, kc, vc, table, pos, packed, groups


def _check(q, kc, vc, table, pos, packed, groups, tol):
    """The named slots hold their window entry's attention, the others zeros."""
    D = q.shape[-1]
    ref = block_attention_ref(q, kc, vc, table, pos, pos, D ** -0.5)                # [B, W, H, D]
    got = grouped_block_attention(packed, kc, vc, *groups, D ** -0.5)
    assert got.shape == packed.shape
    live = groups.q_index >= 0
    idx = groups.q_index[live].long()
    assert (got[idx, 0].float() - ref[live].float()).abs().max() <= tol
    named = torch.zeros(packed.shape[0], dtype=torch.bool, device=packed.device)
    named[idx] = True
    assert not got[~named].any()
    return got


def test_grouped_attention_reference_path_equals_the_window():
    """CPU (fp64): the slots of rows of different lengths (0 = an inert row) equal the window's
    attention exactly; the pad slots come out zero."""
    lengths = torch.tensor([3, 0, 8, 1, 5])
    _check(*_window(5, 8, 8, 2, 8, 4, 13, lengths, "cpu", torch.float64), tol=0.0)


def test_slot_groups_name_each_rows_slots_in_order():
    lengths = torch.tensor([2, 0, 3])
    pos = torch.arange(4)[None, :].repeat(3, 1) + 10
    g = slot_groups(lengths, pos, torch.zeros(3, 1, dtype=torch.long))
    assert g.q_index.tolist() == [[0, 1, -1, -1], [-1] * 4, [2, 3, 4, -1]]
    assert g.positions.tolist() == [[10, 11, -1, -1], [-1] * 4, [10, 11, 12, -1]]
    assert g.q_index.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel)")
@pytest.mark.parametrize("B,ctx", [(64, 300), (4, 5000)])
def test_grouped_attention_kernel_qwen_shapes_bf16(B, ctx):
    """The indexed kernel at Qwen3-8B's heads (bf16, tolerance of the block-attention tests), and
    the same output replayed from a CUDA graph."""
    lengths = torch.randint(0, 9, (B,), generator=torch.Generator().manual_seed(B)).cuda()
    args = _window(B, 8, 32, 8, 128, 16, ctx, lengths, "cuda", torch.bfloat16)
    got = _check(*args, tol=2e-2)
    q, kc, vc, table, pos, packed, groups = args
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_block_attention(packed, kc, vc, *groups, 128 ** -0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_indexed_launch_names_a_mismatched_index():
    """The kernel wrapper refuses a ``q_index`` whose shape is not the positions' (before any launch)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.kernels.block_attention import block_attention_triton
    q, kc, vc, table, pos, packed, groups = _window(2, 4, 8, 2, 16, 4, 5, torch.tensor([2, 3]), "cpu",
                                                    torch.float32)
    with pytest.raises(ValueError, match=r"q_index \(2, 3\) must have the shape of positions \(2, 4\)"):
        block_attention_triton(packed, kc, vc, table, pos, pos, 0.25, q_index=groups.q_index[:, :3])


@pytest.mark.parametrize("kernel", ["block_attention_kernel", "block_attention_split_kernel",
                                    "block_attention_reduce_kernel"])
def test_indexed_kernels_compile_for_sm90(kernel):
    """The indexed launches' kernels compile for the H100 / H200 (sm_90, on the CPU): what the
    interpreter cannot show (e.g. a store masked by a scalar)."""
    triton = pytest.importorskip("triton", reason="Triton is not installed")
    from dspark_trt.plugins.aot import OPTIONS, TARGET
    from dspark_trt.plugins.kernels import block_attention as kba
    fn = getattr(kba, kernel)
    types = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "out": "*bf16", "block_table": "*i64",
             "positions": "*i64", "kv_limit": "*i64", "part_ml": "*fp32", "part_acc": "*fp32", "counter": "*i32",
             "q_index": "*i32", "scale": "fp32"}
    consts = dict(H=32, HKV=8, D=128, BLOCK_T=8, BLOCK_N=64, PREFETCH=True, KVH_FIRST=True, TICKET=False,
                  PDL=False, INDEXED=True, BLOCK_S=4)
    consts = {a: v for a, v in consts.items() if a in fn.arg_names}
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    try:
        k = triton.compile(src, target=TARGET, options={**OPTIONS, "num_warps": 4})
    except RuntimeError as e:           # e.g. a Triton without the CUDA backend's ptxas
        pytest.skip(f"Triton cannot compile for cuda sm_90 on this machine: {e}")
    assert "q_index" in fn.arg_names and k.asm["ptx"]
