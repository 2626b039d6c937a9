"""dspark::noncausal_swa_indices — the DeepSeek-V4 draft block's sparse index list (algorithm doc §9.3).

Every query of a row's block of N tokens anchored at position P sees the same positions
``[max(P - W, 0), P + N)``: the last W context positions and the whole block (non-causal).
Positions map to flat KV rows through a block table (``row = table[b, pos // page] * page +
pos % page``); a slot cache of length L is the case ``page = L``, ``table[b, 0] = slot``.
The list is padded with -1 to ``width`` (a multiple of 128, >= W + N: a block that would not fit is
an error, never truncated). Inert rows (start < 0) get all -1 and length 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import use_triton
from ..opspec import AotDesc, OnnxNode, OpSpec


def index_width(window: int, num_queries: int) -> int:
    """cdiv(W + N, 128) * 128, the smallest valid width."""
    return -(-(window + num_queries) // 128) * 128


def check_width(window: int, num_queries: int, width: int) -> None:
    if width % 128 != 0:
        raise ValueError(f"index width {width} is not a multiple of 128")
    if window + num_queries > width:
        raise ValueError(f"a block of {num_queries} queries with window {window} needs "
                         f"{window + num_queries} index entries, more than the width {width}")


def noncausal_swa_indices_ref(start: Tensor, block_table: Tensor, num_queries: int, page_size: int,
                              window: int, width: int) -> tuple[Tensor, Tensor]:
    """start [B] (P, -1 inert); block_table [B, pages] -> indices [B, N, width] int32, lens [B, N] int32."""
    check_width(window, num_queries, width)
    B = start.shape[0]
    live = start >= 0
    first = (start - window).clamp(min=0)                                       # [B]
    count = torch.where(live, start + num_queries - first, 0)                   # [B] <= W + N
    off = torch.arange(width, device=start.device)
    pos = first[:, None] + off                                                  # [B, width]
    page = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    row = block_table.gather(1, page) * page_size + pos % page_size
    idx = torch.where(off[None, :] < count[:, None], row, -1).to(torch.int32)
    return (idx[:, None, :].expand(B, num_queries, width).contiguous(),
            count[:, None].expand(B, num_queries).to(torch.int32).contiguous())


@torch.library.triton_op("dspark::noncausal_swa_indices", mutates_args=())
def noncausal_swa_indices(start: Tensor, block_table: Tensor, num_queries: int, page_size: int,
                          window: int, width: int) -> tuple[Tensor, Tensor]:
    if use_triton(start):
        check_width(window, num_queries, width)
        from ..kernels.swa_indices import noncausal_swa_indices_triton
        return noncausal_swa_indices_triton(start, block_table, num_queries, page_size, window, width)
    return noncausal_swa_indices_ref(start, block_table, num_queries, page_size, window, width)


OPS = (
    OpSpec("noncausal_swa_indices", noncausal_swa_indices_ref,
           triton="kernels.swa_indices:noncausal_swa_indices_triton",
           onnx=OnnxNode((("start", "L"), ("block_table", "I")), (("indices", "I32"), ("lens", "I32")),
                         {"num_queries": "int", "page_size": "int", "window": "int", "width": "int"}),
           aot=AotDesc((torch.int64, torch.int64), ("P", "N", "PAGE_SIZE", "WINDOW", "WIDTH"),
                       (torch.int32, torch.int32), {"BLOCK": 256}),
           tensorrt=True, export_safe=True),
)
