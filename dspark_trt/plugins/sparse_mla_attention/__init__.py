"""dspark::sparse_mla_attention — MQA over a shared latent KV gathered through index lists.

For query token t and head h: ``s_j = scale · q[t, h] · kv[idx[t, j]]`` over the entries
``idx[t, j] >= 0``; ``o = Σ_j e^{s_j - m} kv[idx_j, :dv] / (Σ_j e^{s_j - m} + e^{sink[h] - m})``
(the per-head sink only enlarges the denominator). DeepSeek-V4: D = dv = 512 (last 64 dims roped),
scale 512^-0.5. Inputs may be bf16; accumulation is fp32. A token with no valid entry returns 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import use_triton
from ..opspec import AotDesc, OnnxNode, OpSpec


def sparse_mla_attention_ref(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor,
                             scale: float, dv: int, block_h: int = 0) -> Tensor:
    """q [T, H, D]; kv [S, D] (flat latent cache); indices [T, W] int (-1 skip); attn_sink [H]
    -> o [T, H, dv]. ``block_h``: the kernel's head tile (0: its rule); no effect here."""
    acc = torch.promote_types(q.dtype, torch.float32)
    valid = indices >= 0                                                        # [T, W]
    g = kv[indices.clamp(min=0).long()].to(acc)                                 # [T, W, D]
    s = torch.einsum("thd,twd->thw", q.to(acc), g) * scale                      # [T, H, W]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = attn_sink.to(acc)[None, :, None]                                     # [1, H, 1]
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    e = torch.exp(s - m)                                                        # 0 where invalid
    denom = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    o = torch.einsum("thw,twd->thd", e / denom, g[..., :dv])
    return o.to(q.dtype)


@torch.library.triton_op("dspark::sparse_mla_attention", mutates_args=())
def sparse_mla_attention(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, scale: float,
                         dv: int, block_h: int = 0) -> Tensor:
    if use_triton(q):
        from ..kernels.sparse_mla import sparse_mla_attention_triton
        return sparse_mla_attention_triton(q, kv, indices, attn_sink, scale, dv, block_h=block_h or None)
    return sparse_mla_attention_ref(q, kv, indices, attn_sink, scale, dv)


def sparse_mla_attention_bucketed(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, scale: float,
                                  dv: int) -> Tensor:
    """``dspark::sparse_mla_attention`` as the models call it. A concrete token count picks the head
    tile inside the op (16 heads for few tokens, else 64: ``kernels.sparse_mla.mla_config``). A
    symbolic one on a GPU (an engine's dynamic batch) gets the same choice on the host: a
    ``torch.cond`` on the count calls the op with ``block_h`` 16 or 64, so each branch compiles its
    own tile (H100, one batch row of 8 tokens: 9.9-10.0 us with 16 heads against 17.4-19.6 with 64,
    which an export took for every count before).

    Named ``dspark::sparse_mla_attention`` to torch-function modes (``_qualified_op_name``): the
    builder's ``ReferenceOps`` sees this call as the op (to inline or to keep), which it could not
    inside ``torch.cond``'s branches."""
    if torch.overrides.has_torch_function_variadic(q, kv, indices, attn_sink):
        return torch.overrides.handle_torch_function(sparse_mla_attention_bucketed, (q, kv, indices, attn_sink),
                                                     q, kv, indices, attn_sink, scale, dv)
    T = q.shape[0]
    if not (use_triton(q) and isinstance(T, torch.SymInt)):
        return torch.ops.dspark.sparse_mla_attention(q, kv, indices, attn_sink, scale, dv)
    from ..kernels.sparse_mla import NARROW_BLOCK_H, WIDE_BLOCK_H, narrow_token_limit
    few = narrow_token_limit(q.shape[1], dv, q.device)

    def tile(block_h: int):
        return lambda q, kv, indices, attn_sink: torch.ops.dspark.sparse_mla_attention(
            q, kv, indices, attn_sink, scale, dv, block_h)
    return torch.cond(T <= few, tile(NARROW_BLOCK_H), tile(WIDE_BLOCK_H), (q, kv, indices, attn_sink))


sparse_mla_attention_bucketed._qualified_op_name = "dspark::sparse_mla_attention"


def _aot_constants() -> dict:
    """The tile an export takes for a dynamic token count (``kernels.sparse_mla.mla_config``): 64
    heads x 64 entries over whole lists (a TensorRT engine's batch is dynamic too)."""
    from ..kernels.sparse_mla import MAX_SCAN, MLA_DEFAULTS, WIDE_BLOCK_H
    return {"SCALE": 512 ** -0.5, "D": 512, "DV": 512, "BLOCK_H": WIDE_BLOCK_H,
            "BLOCK_N": MLA_DEFAULTS["block_n"], "BLOCK_SCAN": MAX_SCAN, "PREFETCH": MLA_DEFAULTS["prefetch"]}


OPS = (
    OpSpec("sparse_mla_attention", sparse_mla_attention_ref,
           triton="kernels.sparse_mla:sparse_mla_attention_triton",
           onnx=OnnxNode((("q", "T"), ("kv", "T"), ("indices", "I32"), ("attn_sink", "F")),
                         (("out", "T"),), {"scale": "float", "dv": "int"}),
           aot=AotDesc(("T", "T", torch.int32, torch.float32), ("W", "H"), ("T",), _aot_constants,
                       num_warps=8, num_stages=2),   # mla_config's for 64-row (wgmma) tiles
           tensorrt=True, export_safe=True),
)
