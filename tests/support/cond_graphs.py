"""Reading exported graphs with ``torch.cond`` buckets."""
from __future__ import annotations

import torch


def cond_leaf_args(gm, targets: tuple, index: int) -> list:
    """Argument ``index`` (0 where the call has fewer) of every call to one of ``targets`` in ``gm``
    and under its nested ``torch.cond``s, true branches first."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.higher_order.cond:
            for br in n.args[1:3]:
                out += cond_leaf_args(getattr(gm, br.target), targets, index)
        elif n.op == "call_function" and n.target in targets:
            out.append(n.args[index] if len(n.args) > index else 0)
    return out
