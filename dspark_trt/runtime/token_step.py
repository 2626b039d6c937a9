"""The Qwen3 target's decode step for a few tokens (one, a verify block, a small batch: up to
``decode_gemv.MAX_ROWS`` in all) as a chain of fused Triton kernels, each launched with
programmatic dependent launch where the GPU has it (issue #21). ``LLM``'s eager Qwen3 modules
run it with ``DSPARK_DECODE_CHAIN=auto``, the default (``networks.DECODE_CHAIN_DEFAULT``: on a CUDA
GPU, bf16, TP 1, beside eager or compiled modules; the modules elsewhere), ``=1`` (an error where
it cannot run; ``chain_for``) or ``=0`` (the modules everywhere). The target's steps of at most ``MAX_ROWS`` tokens
run here, larger ones (most prefills, big verifies) through the modules; so does the DSpark
draft's block pass of B x N <= ``MAX_ROWS`` tokens (``draft_logits``: the same layers,
non-causal over the block, its Markov sampler after). On the H200 at Qwen3-8B dims (36 layers,
``benchmarks/results/token-step-NVIDIA-H200-40cfc72.json.gz``): AR step 4.67 ms (68 % of the HBM
roofline; modules 7.38), 8-token verify 5.14 ms (modules 9.07), 5-layer draft block 1.01 ms
(modules 1.55).

Per layer (``models.qwen3.Qwen3DecoderLayer.deferred`` for the step's tokens, six launches):

    qkv  = decode_gemv(W_qkv, rmsnorm(x + mlp_prev))     writes x' = x + mlp_prev (program 0)
    q    = qk_rope_cache(qkv)                            q/k norm, RoPE, K/V into the paged cache
    o    = block_attention(q)                            split + reduce
    a    = decode_gemv(W_o, o)
    gu   = decode_gemv(W_gate_up, rmsnorm(x' + a))       writes x'' = x' + a
    mlp  = decode_gemv(W_down, silu(gate) * up)

and the head ``decode_gemv(W_lm, rmsnorm(x'' + mlp))`` of the last layer. Norms, residual adds and
SwiGLU live in the GEMV prologues, so no elementwise kernel sits between two GEMVs, and with
``pdl=True`` (sm_90+) each kernel launches while its predecessor drains and loads its first
weight tile before it waits (``benchmarks/pdl_gemv_probe.py``: a 36-layer chain of Qwen3-8B's
GEMVs at 84.7 % of the HBM roofline with PDL, 80.9 % without, cuBLAS 75.3 %); ``qk_rope_cache``
and attention read the step's indices (positions, kv limits, block table: no kernel of the chain
writes them) before the wait too, so only their dependent data loads follow it. Only the embedding
lookup and the token's RoPE rows are torch ops, once per step.

L2 prefetch lost or tied on an H100 and was removed, both kinds: session 31's prefetch of the
o weight from ``qk_rope_cache`` (AR step +1.2-1.8 ms) and session 32's one-token GEMVs
bulk-prefetching their own rows before their PDL wait (AR step, batch 1, 128 tokens: chain_pdl
6.151 ms, with it 6.126 (o, 32 KiB a program) to 7.689 ms (every GEMV, whole rows); at 8192
tokens and at batch 16 within noise or worse;
``token-step-batch-gemv-prefetch-NVIDIA-H100-80GB-HBM3-7915627.json.gz``).

Weight-only fp8 targets (``--quantization fp8``, a Qwen3-FP8 checkpoint: e4m3 projections with
128x128 block scales) run the same chain with the GEMVs reading the fp8 codes and their scales
(``decode_gemv(w_scale=...)``: half the weight bytes); W8A8 ones (``fp8-w8a8``) keep the modules,
whose activation quantisation the chain does not do. The head stays bf16.

Numerics: the modules' roundings in every prologue (``decode_gemv``, ``qk_rope_cache``) but the
RMSNorm of steps of 2+ tokens (``decode_rows``: a deferred scale, within about a bf16 ulp); the
GEMVs' fp32 sums run in another order than cuBLAS's, so logits differ from the module step by
bf16 rounding noise (tests: within a tolerance, the caches' K/V within one bf16 ulp). The taps of
``tap_layer_ids`` (the residual stream after those layers, never the last) are the residual sums
the next layer's q/k/v GEMV writes anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config.checks import ConfigError
from ..models.layers import rope_cos_sin
from ..models.dspark_qwen3 import DSparkQwen3Draft
from ..models.qwen3 import Qwen3ForCausalLM
from ..plugins.kernels.block_attention import block_attention_triton
from ..plugins.kernels.common import INTERPRET, pdl_capable
from ..plugins.kernels.decode_gemv import MAX_ROWS, decode_gemv
from ..plugins.kernels.qk_rope_cache import qk_rope_cache
from ..plugins.fp8_linear import FP8_BLOCK, FP8_DTYPE
from .networks import DECODE_CHAIN_ENV as ENV, decode_chain_flag


@dataclass
class LayerWeights:
    qkv: Tensor          # [(H + 2 Hkv) D, d] fused q/k/v rows
    o: Tensor            # [d, H D]
    gate_up: Tensor      # [2 I, d] fused gate/up rows
    down: Tensor         # [d, I]
    input_norm: Tensor   # [d]
    post_norm: Tensor    # [d]
    q_norm: Tensor       # [D]
    k_norm: Tensor       # [D]
    scales: dict = field(default_factory=dict)   # fp8 projections: name -> fp32 128x128 block scales


def _projection(*linears) -> tuple[Tensor, Tensor | None]:
    """The weight of ``linears`` stacked by rows (one linear: its own) and, where they are fp8
    (``Fp8Linear`` / ``FusedFp8Linear``, weight-only), their block scales stacked alike (else None)."""
    if any(getattr(lin, "act_quant", False) for lin in linears):
        raise ValueError("the chain runs weight-only fp8 projections; these quantise their activations too "
                         "(W8A8, --quantization fp8-w8a8)")
    weight = torch.cat([lin.weight for lin in linears]) if len(linears) > 1 else linears[0].weight
    scales = [getattr(lin, "weight_scale_inv", None) for lin in linears]
    if all(s is None for s in scales):
        return weight.detach(), None
    if any(s is None for s in scales) or any(lin.out_features % FP8_BLOCK for lin in linears[:-1]):
        raise ValueError(f"fp8 parts of {[lin.out_features for lin in linears]} rows do not stack by "
                         f"{FP8_BLOCK}-row scale blocks")
    return weight.detach(), torch.cat(scales).detach().contiguous()


def layer_weights(layer) -> LayerWeights:
    """A ``Qwen3DecoderLayer``'s weights in the chain's layout (its fused q/k/v and gate/up
    weights where ``models.fuse`` fused them, else the parts stacked once here): bf16, or fp8 e4m3
    projections with their 128x128 block scales (weight-only ``--quantization fp8``)."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = {"qkv": (attn.qkv_proj,) if attn.qkv_proj is not None else (attn.q_proj, attn.k_proj, attn.v_proj),
             "o": (attn.o_proj,),
             "gate_up": (mlp.gate_up_proj,) if mlp.gate_up_proj is not None else (mlp.gate_proj, mlp.up_proj),
             "down": (mlp.down_proj,)}
    proj = {name: _projection(*linears) for name, linears in parts.items()}
    w = LayerWeights(*(proj[name][0] for name in parts), layer.input_layernorm.weight.detach(),
                     layer.post_attention_layernorm.weight.detach(), attn.q_norm.weight.detach(),
                     attn.k_norm.weight.detach(), {name: s for name, (_, s) in proj.items() if s is not None})
    bad = [name for name, t in vars(w).items() if name != "scales"
           and t.dtype != torch.bfloat16 and not (name in w.scales and t.dtype == FP8_DTYPE)]
    if bad:
        raise ValueError(f"token_step: the chain's kernels are bf16 only; {', '.join(bad)} are not (load the "
                         f"target in bfloat16; fp8 projections come with their block scales)")
    return w


class TokenStep:
    """The decode step of a ``Qwen3ForCausalLM`` through the fused kernel chain (module doc):
    ``__call__(tokens [B, T], positions [B, T], cache, block_table [B, P]) -> (logits [B, T, V],
    taps [B, T, m d])`` with B * T <= ``MAX_ROWS``, each token attending causally up to its own
    position (as ``forward``); the caches are the model's (``make_cache``: per layer [pages,
    page_size, Hkv, D]), written at ``positions`` (negative: padding, nothing written). The
    residual-stream buffers are allocated once per token count, so the call can be captured in a
    CUDA graph."""

    max_rows = MAX_ROWS

    def __init__(self, model, pdl: bool = False, attention: dict | None = None, pdl_one_token: bool = True):
        """``model``: a ``Qwen3ForCausalLM`` target, or a ``DSparkQwen3Draft`` (its block pass:
        ``draft_logits``; no taps). ``pdl``: launch with programmatic dependent launch;
        ``pdl_one_token``: also steps of one token per row (AR steps; ``chain_for`` turns it off).
        ``attention``: launch parameters of ``block_attention_triton`` other than its defaults
        (e.g. ``num_splits``, ``reduce``: what ``token_step_bench.py --attention`` compares)."""
        target = isinstance(model, Qwen3ForCausalLM)
        body = model.model if target else model
        cfg = model.config if target else model.config.layer_config()
        self.model, self.pdl, self.pdl_one_token = model, pdl, pdl_one_token
        self.attention = dict(attention or {})
        self.layers = [layer_weights(layer) for layer in body.layers]
        self.embed = body.embed_tokens
        self.heads, self.eps, self.head_dim = body.layers[0].self_attn.h, cfg.rms_norm_eps, cfg.head_dim
        self.theta, self.taps_from = cfg.rope_theta, tuple(model.tap_layer_ids) if target else ()
        self.final_norm = body.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.hidden = cfg.hidden_size
        self._buffers: dict[int, tuple[list[Tensor], dict[int, Tensor]]] = {}

    def buffers(self, M: int) -> tuple[list[Tensor], dict[int, Tensor]]:
        """[2] residual-stream buffers [M, d], alternating (a GEMV's residual_out must not alias its
        inputs), and the tapped layers' own [M, d]."""
        if M not in self._buffers:
            new = lambda: torch.empty(M, self.hidden, dtype=torch.bfloat16, device=self.lm_head.device)  # noqa: E731
            self._buffers[M] = ([new(), new()], {i: new() for i in self.taps_from})
        return self._buffers[M]

    def __call__(self, tokens: Tensor, positions: Tensor, cache: dict, block_table: Tensor,
                 kv_limit: Tensor | None = None, final_residual: bool = False):
        """``kv_limit`` [B, T]: the last position each token attends to (None: its own, causal).
        ``final_residual``: also the residual stream after the last layer [B, T, d] (the head's
        input before its norm; the head GEMV writes it)."""
        B, T = tokens.shape
        M, pdl, eps = B * T, self.pdl and (T > 1 or self.pdl_one_token), self.eps
        if M > MAX_ROWS:
            raise ValueError(f"TokenStep: {B} x {T} tokens, at most {MAX_ROWS} per step (decode_gemv.MAX_ROWS)")
        stream, tapped = self.buffers(M)
        x = self.embed(tokens.reshape(M).clamp(min=0))                                   # [M, d]
        kv_limit = positions if kv_limit is None else kv_limit
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, x.dtype)           # [B, T, 1, D]
        cos, sin = cos.reshape(M, -1), sin.reshape(M, -1)
        flat_pos = positions.reshape(M)
        pending, flip = None, 0
        for i, w in enumerate(self.layers):
            k_cache, v_cache = cache["k"][i], cache["v"][i]
            if pending is None:                               # first layer: the embedding is the stream
                qkv = decode_gemv(x, w.qkv, "rmsnorm", norm_weight=w.input_norm, eps=eps, pdl=pdl,
                                  w_scale=w.scales.get("qkv"))
            else:
                out = tapped.get(i - 1, stream[flip])         # the stream after layer i - 1: a tap?
                qkv = decode_gemv(pending, w.qkv, "rmsnorm", residual=x, norm_weight=w.input_norm, eps=eps,
                                  residual_out=out, pdl=pdl, w_scale=w.scales.get("qkv"))
                x, flip = out, flip ^ 1
            q = qk_rope_cache(qkv, w.q_norm, w.k_norm, cos, sin, k_cache, v_cache, block_table, flat_pos,
                              self.heads, eps, pdl=pdl)                                  # [M, H, D]
            o = block_attention_triton(q.view(B, T, self.heads, self.head_dim), k_cache, v_cache, block_table,
                                       positions, kv_limit, self.head_dim ** -0.5, pdl=pdl, **self.attention)
            a = decode_gemv(o.reshape(M, -1), w.o, pdl=pdl, w_scale=w.scales.get("o"))
            out = stream[flip]
            gate_up = decode_gemv(a, w.gate_up, "rmsnorm", residual=x, norm_weight=w.post_norm, eps=eps,
                                  residual_out=out, pdl=pdl, w_scale=w.scales.get("gate_up"))
            x, flip = out, flip ^ 1
            pending = decode_gemv(gate_up, w.down, "swiglu", pdl=pdl, w_scale=w.scales.get("down"))
        last = stream[flip] if final_residual else None
        logits = decode_gemv(pending, self.lm_head, "rmsnorm", residual=x, norm_weight=self.final_norm, eps=eps,
                             residual_out=last, pdl=pdl)
        taps = [tapped[i] for i in self.taps_from]
        taps = torch.cat(taps, -1) if taps else x.new_zeros(M, 0)
        if final_residual:
            return logits.view(B, T, -1), taps.view(B, T, -1), last.view(B, T, -1)
        return logits.view(B, T, -1), taps.view(B, T, -1)

    def draft_logits(self, anchor: Tensor, start: Tensor, cache: dict, block_table: Tensor,
                     num_spec_tokens: int, hidden: bool = False):
        """A ``DSparkQwen3Draft``'s block pass through the chain: base logits U [B, N, V] of the
        anchor [B] at start [B] (``block_inputs``: non-causal over the block; its K / V written
        at P .. P+N-1 like the module's); ``hidden``: ``(U, h)`` with the post-norm hidden states
        h [B, N, d] the confidence head reads (the draft's norm over the chain's last residual)."""
        tokens, positions, kv_limit = self.model.block_inputs(anchor, start, num_spec_tokens)
        if not hidden:
            return self(tokens, positions, cache, block_table, kv_limit)[0]
        U, _, last = self(tokens, positions, cache, block_table, kv_limit, final_residual=True)
        return U, self.model.norm(last)


def chain_for(model, device: torch.device, tp_size: int = 1) -> TokenStep | None:
    """The chain ``DSPARK_DECODE_CHAIN`` asks for: a ``TokenStep`` of ``model`` (the target, or the
    draft's block pass), with PDL on sm_90+ GPUs for steps of several tokens per row (verify, the
    draft's block) and without it for one token per row (AR steps), as measured at Qwen3-8B dims:
    with one token PDL was slower in 19 of the 21 chain timings on record (H200 and H100: 0.01-0.24
    ms at batch 1, 0.30-0.48 ms at batch 16; it won by 0.04-0.08 ms in two H100 batch-1 timings at
    8192-32768 tokens), with eight it saved 0.06-0.31 ms in every timing since the 2-16-token kernel
    (``decode_rows.py``; ``benchmarks/results/token-step-*``).
    "1": ``ConfigError`` naming why where it cannot serve it (not a Qwen3 target or DSpark Qwen3
    draft, not bf16, not on a GPU, tensor parallel); "auto" (unset: ``DECODE_CHAIN_DEFAULT``): None
    there instead; "0": None."""
    flag = decode_chain_flag()
    if flag is None:
        return None
    if flag not in ("1", "auto"):
        raise ConfigError(f"{ENV}={flag!r}: set it to 1, 0 or auto")
    why = ("the chain runs Qwen3 targets and their DSpark drafts only"
           if not isinstance(model, (Qwen3ForCausalLM, DSparkQwen3Draft))
           else "the chain's Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)"
           if device.type != "cuda" and not (INTERPRET and flag == "1")
           else "the chain is not sharded for tensor parallelism" if tp_size > 1 else None)
    if why:
        if flag == "auto":
            return None
        raise ConfigError(f"{ENV}: {why}")
    try:
        return TokenStep(model, pdl=pdl_capable(device), pdl_one_token=False)
    except ValueError as e:                                # weights that are not bf16
        if flag == "auto":
            return None
        raise ConfigError(f"{ENV}: {e}") from None

