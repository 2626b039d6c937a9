"""Cache-free ("dense") forwards of the runtime modules, for training and offline evaluation.

They use the parameters of ``Qwen3ForCausalLM`` / ``DSparkQwen3Draft`` as they are, so a trained
module saves under the checkpoint names the loaders read, and the runtime's paged-cache forward
computes the same function (``tests/train/test_train_dense.py`` checks both). RoPE tables are fp32
(under bf16 autocast the attention inputs are cast to bf16 after rotation).

DSpark training attention (algorithm doc §2.5): the block anchored at ``a`` holds the tokens
``[x_a, mask × (N-1)]`` at positions ``a .. a+N-1``; its queries see the context rows ``< a``
(K/V from the taps via ``fc``/``hidden_norm`` and each layer's own k/v projection) and every row of
their own block (non-causal), nothing else.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.layers import apply_rope_neox, rope_cos_sin


def _attend(attn, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
            kv_prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One Qwen3 attention over x [B, T, d]; K/V = [kv_prefix ; own rows]; mask [B, T, S] bool
    (True = visible) or None for causal."""
    B, T, _ = x.shape
    q = (attn.q_proj(x) if attn.qkv_proj is None                        # fused like LLM's modules:
         else F.linear(x, attn.qkv_proj.weight[:attn.qkv_proj.sizes[0]]))  # the q rows of qkv_proj
    q = apply_rope_neox(attn.q_norm(q.view(B, T, attn.h, attn.d)), cos, sin)
    k, v = attn.kv(x, cos, sin)                                           # [B, T, Hkv, D]
    if kv_prefix is not None:
        k, v = torch.cat([kv_prefix[0], k], 1), torch.cat([kv_prefix[1], v], 1)
    rep = attn.h // attn.hkv
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                      # [B, heads, S, D]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k = q.to(v.dtype), k.to(v.dtype)
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.d ** -0.5)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=attn.d ** -0.5)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.h * attn.d))


def _layer(layer, x: Tensor, cos, sin, mask=None, kv_prefix=None) -> Tensor:
    x = x + _attend(layer.self_attn, layer.input_layernorm(x), cos, sin, mask, kv_prefix)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def causal_lm_forward(model, tokens: Tensor, tap_layer_ids=()) -> tuple[Tensor, Tensor]:
    """A ``Qwen3ForCausalLM`` on tokens [B, T] at positions 0..T-1 -> logits [B, T, V],
    taps [B, T, m*d] (raw outputs of ``tap_layer_ids``, concatenated; [B, T, 0] if none)."""
    B, T = tokens.shape
    x = model.model.embed_tokens(tokens)
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    cos, sin = rope_cos_sin(pos, model.config.head_dim, model.config.rope_theta, torch.float32)
    taps = []
    for i, layer in enumerate(model.model.layers):
        x = _layer(layer, x, cos, sin)
        if i in tap_layer_ids:
            taps.append(x)
    logits = model.lm_head(model.model.norm(x))
    return logits, (torch.cat(taps, -1) if taps else x.new_zeros(B, T, 0))


def block_attention_mask(anchors: Tensor, context_len: int, block_size: int) -> Tensor:
    """anchors [B, A] -> visibility [B, A*N, T + A*N] over [context rows ; block rows].

    Query row ``j*N + k`` (block j, anchored at ``a = anchors[:, j]``) sees context key ``t`` iff
    ``t < a`` and block key ``j'*N + k'`` iff ``j' == j``.
    """
    B, A = anchors.shape
    N, dev = block_size, anchors.device
    q_block = torch.arange(A * N, device=dev) // N                                  # [A*N]
    ctx = torch.arange(context_len, device=dev)[None, None, :] < anchors.repeat_interleave(N, 1)[..., None]
    own = (q_block[:, None] == q_block[None, :]).expand(B, A * N, A * N)
    return torch.cat([ctx, own], -1)


def block_tokens(tokens: Tensor, anchors: Tensor, block_size: int, mask_token_id: int):
    """-> block token ids [B, A, N] (``[x_a, mask × (N-1)]``) and positions [B, A, N] (a + k)."""
    B, A = anchors.shape
    ids = torch.full((B, A, block_size), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    ids[..., 0] = tokens.gather(1, anchors)
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return ids, pos


def draft_block_logits(draft, taps: Tensor, tokens: Tensor, anchors: Tensor,
                       return_hidden: bool = False):
    """Base logits U [B, A, N, V] of the blocks anchored at anchors [B, A] (no Markov bias);
    with ``return_hidden`` also the post-norm hidden states [B, A, N, d] (confidence head input).

    taps [B, T, m*d] are the frozen target's features of tokens [B, T] at positions 0..T-1.
    """
    B, T = tokens.shape
    A, N = anchors.shape[1], draft.config.block_size                # trained on its block size
    lc = draft.config.backbone
    ctx = draft.hidden_norm(draft.fc(taps))                                          # [B, T, d]
    ctx_pos = torch.arange(T, device=tokens.device).expand(B, T)
    ccos, csin = rope_cos_sin(ctx_pos, lc.head_dim, lc.rope_theta, torch.float32)
    ids, pos = block_tokens(tokens, anchors, N, draft.config.mask_token_id)
    x = draft.embed_tokens(ids.view(B, A * N))
    cos, sin = rope_cos_sin(pos.view(B, A * N), lc.head_dim, lc.rope_theta, torch.float32)
    mask = block_attention_mask(anchors, T, N)
    for layer in draft.layers:
        kv_ctx = layer.self_attn.kv(ctx, ccos, csin)
        x = _layer(layer, x, cos, sin, mask, kv_ctx)
    h = draft.norm(x)
    U = draft.lm_head(h).view(B, A, N, -1)
    return (U, h.view(B, A, N, -1)) if return_hidden else U
