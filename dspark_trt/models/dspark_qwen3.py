"""DSpark draft for a Qwen3 target (DFlash backbone + Markov head), algorithm doc §2-3.

* ``context``: ``ctx = hidden_norm(fc(cat(taps)))``; each draft layer writes K/V of the context rows
  from ``ctx`` with its own k_proj/k_norm/RoPE and v_proj (no query, no MLP, no input norm).
* ``block``: N tokens ``[anchor, mask × (N-1)]`` at positions ``P .. P+N-1`` run through the draft
  layers; every query sees the whole context and the whole block (non-causal), then
  ``U = lm_head(norm(h))`` with the target's frozen head.
* ``forward`` (the draft_block network): block + Markov sampler -> drafts [B, N], logits z [B, N, V];
  with ``with_confidence`` also the confidence logits [B, N] of the confidence head (paper eq. 7):
  ``c_k = sigmoid(proj([h_k ; W1[x_{k-1}]]))`` on the post-norm hidden h_k and the Markov head's
  embedding of the previous sampled token (the anchor for k = 0), computed in the same forward.

Parameter names equal the published DSpark checkpoint names (``fc.weight``, ``layers.0...``,
``markov_head.markov_w1.weight``, ``confidence_head.proj.{weight,bias}``); ``embed_tokens``/``lm_head``
are the target's modules.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import plugins
from ..config import DSparkConfig
from ..plugins.dispatch import use_triton
from ..config.source import MARKOV_SAMPLERS, resolve_num_spec_tokens
from .layers import RMSNorm, make_paged_kv_cache, rope_cos_sin
from .qwen3 import Qwen3DecoderLayer, add_norm, local_kv_heads, run_layers


class MarkovHead(nn.Module):
    """First-order low-rank bias ``B_k = W2 · W1[x_{k-1}]`` (paper eq. 4-5)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)            # W1 [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)    # W2 stored [V, r]

    def bias(self, prev: Tensor) -> Tensor:
        """prev [...] token ids -> [..., V]."""
        return self.markov_w2(self.markov_w1(prev))


def markov_weights(draft: nn.Module, like: Tensor) -> tuple[Tensor, Tensor]:
    """A draft's (W1 [V, r], W2 [V, r]) for the sampler; no head (rank 0, DFlash) gives [V, 0]
    matrices with the dtype and device of ``like``. A draft with a draft vocabulary has given its
    tables to ``draft.draft_vocab`` (``markov_inputs``)."""
    if draft.draft_vocab is not None:
        raise RuntimeError("this draft samples over a draft vocabulary: its Markov tables are "
                           "draft.draft_vocab.markov_inputs(anchor)")
    if draft.markov_head is None:
        w = like.new_zeros(draft.config.backbone.vocab_size, 0)
        return w, w
    return draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight


class ConfidenceHead(nn.Module):
    """DeepSpec's confidence head: ``proj`` [1, d + r] on ``[h_k ; W1[x_{k-1}]]`` (bias: Qwen3 yes,
    DeepSeek-V4 no). ``forward`` returns the logit; ``c_k = sigmoid(logit)`` (calibrated:
    ``sigmoid(logit / T_k)``, ``runtime/confidence.py``)."""

    def __init__(self, in_features: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=bias)

    def forward(self, h: Tensor, w1_prev: Tensor) -> Tensor:
        """h [..., d], w1_prev [..., r] -> confidence logits [...] float32."""
        x = torch.cat([h, w1_prev.to(h.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


def window_rows(h: Tensor, width: int | None) -> Tensor:
    """The block hidden states [B, N, d] of a window's first ``width`` drafts (None: all N), made
    contiguous: on the strided slice cuBLAS picked an 18.9 ms lm_head kernel (H200, B = 64, w = 2)."""
    return h if width is None else h[:, :width].contiguous()                      # [B, w, d]


def confidence_logits(draft: nn.Module, h: Tensor, anchor: Tensor, drafts: Tensor) -> Tensor:
    """A draft's confidence logits [B, N] of a sampled block: row k uses h_k and W1[x_{k-1}]
    (x_{-1} = anchor; W1 of the Markov head or of the draft vocabulary); inert rows (anchor < 0)
    get -inf (c = 0)."""
    prev = torch.cat([anchor[:, None], drafts[:, :-1]], 1).clamp(min=0)
    vocab = draft.draft_vocab
    w1_prev = draft.markov_head.markov_w1(prev) if vocab is None else vocab.w1_rows(prev)
    c = draft.confidence_head(h, w1_prev)
    return torch.where((anchor >= 0)[:, None], c, float("-inf"))


def check_confidence_head(head: ConfidenceHead, d: int, r: int, bias: bool, where: str) -> None:
    """A head of the published shape: proj [1, d + r] (+ bias [1] when ``bias``)."""
    w = tuple(head.proj.weight.shape)
    if w != (1, d + r):
        raise ValueError(f"{where}: confidence_head.proj.weight has shape {w}, expected (1, {d + r}) "
                         f"(hidden {d} + markov rank {r})")
    if bias != (head.proj.bias is not None):
        raise ValueError(f"{where}: confidence_head.proj.bias is {'missing' if bias else 'unexpected'}")

TOPK_PER_CHUNK = 4                           # topk: 4 candidates per vocabulary chunk ...


def topk_chunk(vocab_size: int) -> int:
    """... of a power-of-two size up to 4096 giving >= 32 chunks (152 candidates at V=151936)."""
    return min(4096, max(16, 1 << (-(-vocab_size // 32) - 1).bit_length()))


def markov_sampler_op(mode: str):
    """The plugin that samples a block: ``exact`` (full-vocabulary Markov sampler, the paper's) or
    ``topk`` (candidate-restricted proposal whose logits z are exactly what was sampled, so
    verification stays lossless; acceptance can differ slightly from exact)."""
    if mode not in MARKOV_SAMPLERS:
        raise ValueError(f"markov_sampler must be one of {MARKOV_SAMPLERS}, got {mode!r}")
    if mode == "exact":
        return plugins.markov_sample

    def topk(U, anchor, w1, w2, temperature, seed, start):
        return plugins.markov_sample_topk(U, anchor, w1, w2, temperature, seed, start,
                                          topk_chunk(U.shape[-1]), TOPK_PER_CHUNK)
    return topk


def sample_block(mode: str, U: Tensor, anchor: Tensor, w1: Tensor, w2: Tensor, temperature: Tensor,
                 seed: Tensor, start: Tensor, z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``markov_sampler_op(mode)`` -> drafts [B, w], z [B, w, V]; with ``z_out`` (contiguous fp32
    [B, w, V], the caller's: the CUDA graphs of a batch bucket's confidence rounds share one) z is
    written there, by the exact sampler's kernel itself on a GPU, else copied."""
    if z_out is None:
        return markov_sampler_op(mode)(U, anchor, w1, w2, temperature, seed, start)
    if mode == "exact" and use_triton(U) and not torch.compiler.is_compiling():
        from ..plugins.kernels.markov_launch import markov_sample_triton
        return markov_sample_triton(U, anchor, w1, w2, temperature, seed, start, z_out=z_out)
    drafts, z = markov_sampler_op(mode)(U, anchor, w1, w2, temperature, seed, start)
    return drafts, z_out.copy_(z)


def sample_drafts(draft: nn.Module, mode: str, U: Tensor, anchor: Tensor, temperature: Tensor, seed: Tensor,
                  start: Tensor, z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A draft's Markov sampler over its base logits U [B, w, V] -> drafts [B, w], z [B, w, V]; a
    draft with a draft vocabulary (``draft_vocab.DraftVocab``) samples over its U [B, w, Vs] and
    gives token ids and z over the full vocabulary (-inf outside the set)."""
    vocab = draft.draft_vocab
    if vocab is None:
        w1, w2 = draft.markov_weights()
        return sample_block(mode, U, anchor, w1, w2, temperature, seed, start, z_out)
    local, w1, w2 = vocab.markov_inputs(anchor)
    drafts, z = sample_block(mode, U, local, w1, w2, temperature, seed, start)
    return vocab.to_full(drafts, z, anchor, z_out)


class DSparkQwen3Draft(nn.Module):
    """Holds weights and shapes only: N (``num_spec_tokens``, default ``config.block_size``) and
    the Markov sampler mode (default "exact") are arguments of ``block`` / ``forward``."""

    def __init__(self, cfg: DSparkConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.config = cfg
        lc = cfg.layer_config()
        d = lc.hidden_size
        self.embed_tokens = embed_tokens            # shared with the target (frozen)
        self.lm_head = lm_head
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, lc.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(lc) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, lc.rms_norm_eps)
        self.markov_head = MarkovHead(lc.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence_head = None
        self.draft_vocab = None                     # draft_vocab.restrict_draft_vocab_
        if cfg.enable_confidence_head and cfg.markov_rank:
            self.add_confidence_head()

    def add_confidence_head(self) -> ConfidenceHead:
        """Attach a (randomly initialised) head: ``proj`` [1, d + r] with bias. Needs a Markov head."""
        if self.markov_head is None:
            raise ValueError("a confidence head needs the Markov head (markov_rank > 0): its input "
                             "is [h_k ; W1[x_{k-1}]]")
        p = self.fc.weight
        d, r = self.config.backbone.hidden_size, self.config.markov_rank
        self.confidence_head = ConfidenceHead(d + r, bias=True).to(device=p.device, dtype=p.dtype)
        return self.confidence_head

    def make_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device) -> dict:
        c = self.config.layer_config()
        return make_paged_kv_cache(c.num_hidden_layers, num_pages, page_size,
                                   local_kv_heads(self.layers, c), c.head_dim, dtype, device)

    def markov_weights(self) -> tuple[Tensor, Tensor]:
        return markov_weights(self, self.lm_head.weight)

    def context(self, taps: Tensor, positions: Tensor, block_table: Tensor, cache: dict) -> None:
        """taps [B, T, m*d] of committed target rows at positions [B, T] (-1 = skip)."""
        row_kernels = len(self.layers) > 0 and self.layers[0].row_kernels     # (``qwen3.use_row_kernels_``)
        ctx = add_norm(self.hidden_norm, self.fc(taps), None, row_kernels)[0]
        lc = self.config.backbone
        cos, sin = rope_cos_sin(positions, lc.head_dim, lc.rope_theta, ctx.dtype)
        for i, layer in enumerate(self.layers):
            layer.self_attn.context_cache(ctx, cos, sin, cache["k"][i], cache["v"][i], block_table, positions)

    def block(self, anchor: Tensor, start: Tensor, block_table: Tensor, cache: dict,
              num_spec_tokens: int | None = None) -> Tensor:
        """anchor [B] at position start [B] (= P) -> base logits U [B, N, V] (row k predicts P+k+1;
        a draft vocabulary's [B, N, Vs]); N = ``num_spec_tokens`` (None: the trained ``config.block_size``)."""
        return self.lm_head(self.block_hidden(anchor, start, block_table, cache, num_spec_tokens))

    def block_inputs(self, anchor: Tensor, start: Tensor,
                     num_spec_tokens: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The block's tokens [B, N] (the anchor, then mask tokens), positions [B, N] (P .. P+N-1,
        -1 for an inert row) and attention limits [B, N] (P + N - 1 for every token: non-causal)."""
        B, N = anchor.shape[0], resolve_num_spec_tokens(num_spec_tokens, self.config)
        offs = torch.arange(N, device=anchor.device)
        mask = torch.full((B, N - 1), self.config.mask_token_id, dtype=anchor.dtype,
                          device=anchor.device)
        tokens = torch.cat([anchor[:, None], mask], 1)                          # [B, N]
        live = (anchor >= 0) & (start >= 0)
        positions = torch.where(live[:, None], start[:, None] + offs, -1)       # [B, N]
        return tokens, positions, positions.amax(1, keepdim=True).expand(B, N)

    def block_hidden(self, anchor: Tensor, start: Tensor, block_table: Tensor, cache: dict,
                     num_spec_tokens: int | None = None) -> Tensor:
        """The post-norm hidden states h [B, N, d] of the block (``U = lm_head(h)``)."""
        tokens, positions, kv_limit = self.block_inputs(anchor, start, num_spec_tokens)
        x = self.embed_tokens(tokens.clamp(min=0))
        lc = self.config.backbone
        cos, sin = rope_cos_sin(positions, lc.head_dim, lc.rope_theta, x.dtype)
        return self.norm(run_layers(self.layers, x, cos, sin, cache, block_table, positions, kv_limit)[0])

    def sample(self, U: Tensor, anchor: Tensor, temperature: Tensor, seed: Tensor, start: Tensor,
               sampler: str = "exact", h: Tensor | None = None, z_out: Tensor | None = None):
        """The Markov sampler over base logits U [B, w, V] (a draft vocabulary's [B, w, Vs]) ->
        drafts [B, w], z [B, w, V]; with the block's post-norm hidden states ``h`` [B, w, d] also
        their confidence logits [B, w]. ``z_out``: the buffer z is written to (``sample_block``)."""
        drafts, z = sample_drafts(self, sampler, U, anchor, temperature, seed, start, z_out)
        if h is None:
            return drafts, z
        return drafts, z, confidence_logits(self, h, anchor, drafts)

    def forward(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                seed: Tensor, cache: dict, with_confidence: bool = False,
                sampler: str = "exact", num_spec_tokens: int | None = None, width: int | None = None,
                z_out: Tensor | None = None):
        """The draft_block network: drafts [B, N] and their proposal logits z [B, N, V]
        (+ confidence logits [B, N] with ``with_confidence``; needs ``confidence_head``).
        ``sampler``: the Markov sampler mode; ``num_spec_tokens``: N (None: ``config.block_size``);
        both are run settings the caller passes (the runtime's networks, the export wrapper).
        ``width`` (< N): sample only the first ``width`` drafts: the block pass is the N-token one
        (the same hidden states), the head and the sequential sampler run on ``width`` rows.
        ``z_out``: a buffer for z (``sample_block``)."""
        h = window_rows(self.block_hidden(anchor, start, block_table, cache, num_spec_tokens), width)
        return self.sample(self.lm_head(h), anchor, temperature, seed, start, sampler,
                           h if with_confidence else None, z_out)
