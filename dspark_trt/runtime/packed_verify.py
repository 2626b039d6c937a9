"""Packed variable-length verify (issue #25, the paper's cost model ``sum_r (1 + l_r)``).

A confidence round whose scheduler packs (``VerifyScheduler(cost_model="packed")``) verifies each
row's own admitted prefix: row r contributes its ``1 + l_r`` window tokens (anchor, drafts
``0 .. l_r - 1`` at positions ``P_r .. P_r + l_r``), the rows' tokens are laid end to end in ``T``
slots (a CUDA-graph bucket >= their sum; the slots past it are inert, position -1), and the
target runs once over them as ``T`` rows of one token each: slot t carries its row's block table,
so its K/V lands in that row's pages and its attention reads that row's cache up to its own
position (every slot's K/V is written before any slot's attention, layer by layer, so a draft
sees the anchor and the drafts before it). The logits and taps come back in the window's
``[B, W]`` layout (row r's entries past ``l_r`` repeat entry ``l_r``; the verifier reads rows
``<= l_r`` only), so acceptance, the bonus row and the draft context are those of the
rectangular verify.

The linear layers then run on ``T`` tokens instead of ``B x (1 + w)``; the attention groups the
slots back into their rows (``SlotGroups``: each row's window entries name their slots), so a row's
cache is read once for all of its slots, as in the rectangular verify (``grouped_block_attention``;
attended one slot each, the slots re-read their row's cache: 1.60 against 0.74 ms per step at batch
64 on an H100). Steps small enough for the decode chain attend each slot on its own. Needs a target
whose rows are independent (the Qwen3 family; ``packs_rows``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..plugins.block_attention import SlotGroups
from ..plugins.finite import rows_finite


def check_packable(networks) -> None:
    """Raise ValueError unless ``networks`` can run a packed verify (``packs_rows``)."""
    if not getattr(networks, "packs_rows", False):
        raise ValueError(f"the 'packed' cost model needs a target whose rows are independent (the "
                         f"Qwen3 family, eager or graphed); {type(networks).__name__} over this "
                         f"target cannot pack: use cost_model 'trimmed'")


def token_buckets(max_tokens: int) -> list[int]:
    """The slot counts a packed verify runs (one CUDA graph each), below ``max_tokens`` and then
    ``max_tokens``: steps of 8 to 64, of 16 to 128, of 32 to 256, then of 64 (a round pays at most
    about 1/8 of its tokens in padding past 16 slots)."""
    out, k = [], 8
    while k < max_tokens:
        out.append(k)
        k += 8 if k < 64 else 16 if k < 128 else 32 if k < 256 else 64
    return out + [max_tokens]


def pack_slots(lengths: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """lengths [B] (window tokens per row, 0 for inert rows; sum <= T) -> (row [T], col [T],
    live [T] bool): slot t holds token ``col[t]`` of row ``row[t]``, rows end to end in row order;
    slots past the sum are not live (row / col clamped into range)."""
    B = lengths.shape[0]
    ends = torch.cumsum(lengths, 0)                                           # [B]
    t = torch.arange(T, device=lengths.device)
    row = torch.searchsorted(ends, t, right=True)                             # [T] in [0, B]
    live = row < B
    row = row.clamp(max=B - 1)
    col = (t - (ends - lengths)[row]).clamp(min=0)
    return row, col, live


def slot_groups(lengths: Tensor, positions: Tensor, table: Tensor) -> SlotGroups:
    """The packed slots grouped back into their rows for the attention: entry (r, j) of the window
    ``positions`` [B, W] is slot ``begin_r + j`` for ``j < lengths[r]``, no slot (-1, position -1)
    past it."""
    W = positions.shape[1]
    begins = torch.cumsum(lengths, 0) - lengths                               # [B]
    j = torch.arange(W, device=lengths.device)[None, :]
    live = j < lengths[:, None]                                               # [B, W]
    index = torch.where(live, begins[:, None] + j, -1).to(torch.int32)
    return SlotGroups(table, torch.where(live, positions, -1), index)


def window_index(lengths: Tensor, W: int, T: int) -> Tensor:
    """[B, W] slot of window entry (r, j), j clamped to the row's last token (``lengths - 1``)."""
    begins = torch.cumsum(lengths, 0) - lengths                               # [B]
    j = torch.arange(W, device=lengths.device)[None, :]
    j = torch.minimum(j, (lengths - 1).clamp(min=0)[:, None])
    return (begins[:, None] + j).clamp(max=T - 1)


def packed_target(target, tokens: Tensor, positions: Tensor, table: Tensor, lengths: Tensor,
                  T: int) -> tuple[Tensor, Tensor, Tensor]:
    """``target(tokens, positions, table)`` over the first ``lengths[r]`` window tokens of each row
    only, packed into ``T`` slots. tokens, positions [B, W] (positions -1 on inert rows); table
    [B, pages]; lengths [B] (<= W, 0 on inert rows) -> logits [B, W, V], taps [B, W, m*d] in the
    window layout (entries past a row's length repeat its last one), and finite [B] bool: every
    logit of the row's slots is finite (read on the slots: no repeated entry read twice)."""
    row, col, live = pack_slots(lengths, T)
    col = col.clamp(max=tokens.shape[1] - 1)                                  # pad slots
    tok = tokens[row, col][:, None]                                           # [T, 1]
    pos = torch.where(live, positions[row, col], -1)[:, None]                 # [T, 1]
    logits, taps = target(tok, pos, table[row], groups=slot_groups(lengths, positions, table))  # [T, 1, .]
    idx = window_index(lengths, tokens.shape[1], T)                           # [B, W]
    finite = rows_finite(logits)[idx].all(-1)                                 # [B]
    return logits[idx, 0], taps[idx, 0], finite
