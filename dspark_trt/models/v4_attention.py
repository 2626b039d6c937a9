"""DeepSeek-V4 attention: MLA with one shared latent, window + compressed KV (doc §8.3-8.4).

Per layer: ``q = rope(rms(wq_b(q_norm(wq_a(x)))))`` [H, D]; ``kv = rope(kv_norm(wkv(x)))`` [D] is
both key and value; RoPE on the last ``rope`` dims in interleaved pairs; attention over an index
list with a per-head sink (``dspark::sparse_mla_attention``); inverse RoPE on the output; grouped
low-rank output ``wo_b(einsum(o, wo_a))``. The index list is the window (given by the caller:
causal for the target, non-causal for the DSpark draft) plus, for compressed layers, compressed
entries: all completed ones (HCA) or the indexer's top-k (CSA, ratio 4).

**Compressed state and speculative rollback.** Nothing here is an incremental running state.
Each token writes, at its own position, its latent row and its compressor inputs
(``wkv(x) | wgate(x)``, for the indexer's compressor too). A compressed entry ``c`` is a pure
function of the compressor inputs at positions ``[(c - overlap) r, (c + 1) r)``; it is
(re)computed and written (at the row of position ``c r``) whenever the block's last position
``(c + 1) r - 1`` is processed, after that forward wrote the inputs of its own tokens. A query at
``p`` reads entry ``c`` only if ``(c + 1) r - 1 <= p``. So after a partial accept, every rejected
position ``>= P'`` is processed again by the next round before any query can read what it fed,
exactly like plain KV: rollback by length keeps the window, both compressed pools and the indexer
keys consistent, with no copy. (Entries live at one row per ``r`` positions of a full-length
paged buffer: simple addressing through the shared block table at 1/r density, not the packed
production layout.)

**Latent cache format** (``kv_format``): "auto" keeps the latent rows in the model's dtype;
``mla_fp8.FORMAT`` ("fp8_ds_mla") stores every latent row (window and compressed pool) as the
584-byte fp8 row of vLLM's V4 cache (``mla_fp8.py``: NoPE in fp8 with a power-of-two scale per 64
dims, RoPE in bf16), which is also what the reference model's fp8 fake-quantisation of the NoPE
part computes. The attention reads rows decoded to the model's dtype (``mla_fp8.attention_rows``:
those its index list names, or the whole cache once where the queries name more entries than it
has rows).

Not reproduced: the Hadamard rotation of indexer queries/keys (orthogonal, so it leaves the float
scores unchanged).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import DeepSeekV4Config
from ..plugins.sparse_mla_attention import sparse_mla_attention_bucketed
from . import mla_fp8
from .layers import RMSNorm
from .v4_layers import apply_rope_tail, flat_rows, read_rows, rms, rope_cos_sin, rope_inv_freq, write_rows


def layer_inv_freq(cfg: DeepSeekV4Config, ratio: int, device=None) -> Tensor:
    """SWA-only layers: plain RoPE at rope_theta; compressed layers: compress_rope_theta + YaRN."""
    if ratio == 0:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, device=device)
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling, device)


def _zeros(num_pages: int, page: int, dim: int, dtype, device, lead: tuple = ()) -> Tensor:
    return torch.zeros(*lead, num_pages + 1, page, dim, dtype=dtype, device=device)


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one entry of width ``dim`` (ratio 4: overlapping,
    each entry pools the previous block through the first half of the channels)."""

    def __init__(self, cfg: DeepSeekV4Config, ratio: int, dim: int):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = nn.Linear(cfg.hidden_size, coff * dim, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, coff * dim, bias=False)
        self.ape = nn.Parameter(torch.randn(ratio, coff * dim) * 0.1)
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)

    @property
    def state_dim(self) -> int:
        return 2 * self.wkv.out_features

    def inputs(self, x: Tensor) -> Tensor:
        """x [B, T, d] -> per-position compressor inputs [B, T, state_dim] = wkv(x) | wgate(x)."""
        return torch.cat([self.wkv(x), self.wgate(x)], -1)

    def entries(self, state: Tensor, block_table: Tensor, positions: Tensor, page: int,
                inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """Entries completed by these tokens: -> (entries [B, T, dim], entry position [B, T]: c*r
        for a token at a block end (p + 1 = (c + 1) r), else -1)."""
        r, D = self.ratio, self.dim
        L = 2 * r if self.overlap else r
        B, T = positions.shape
        j = torch.arange(L, device=positions.device)
        src = positions[..., None] - L + 1 + j                                  # [B, T, L]
        rows = flat_rows(block_table, src.flatten(1), page).view(B, T, L)
        st = read_rows(state, rows)                                             # [B, T, L, S]
        acc = torch.promote_types(st.dtype, torch.float32)
        kv, score = st.to(acc).chunk(2, -1)                                     # [B, T, L, coff*D]
        score = score + self.ape.to(acc)[j % r]
        if self.overlap:                      # previous block: channels [:D]; own block: [D:]
            own = (j >= r)[:, None]
            kv = torch.where(own, kv[..., D:], kv[..., :D])
            score = torch.where(own, score[..., D:], score[..., :D])
        valid = (rows >= 0)[..., None]
        score = score.masked_fill(~valid, float("-inf"))
        w = torch.where(valid, score.softmax(-2).nan_to_num(0.0), 0.0)
        entry = self.norm((w * kv).sum(-2).to(state.dtype))                      # [B, T, D]
        first = positions + 1 - r
        is_end = (positions >= 0) & ((positions + 1) % r == 0)
        cos, sin = rope_cos_sin(first, inv_freq, entry.dtype)
        entry = apply_rope_tail(entry, cos, sin)
        return entry, torch.where(is_end, first, -1)


class Indexer(nn.Module):
    """CSA top-k selection: ``score_c = sum_h relu(q_h . k_c) w_h``, over completed entries."""

    def __init__(self, cfg: DeepSeekV4Config, ratio: int):
        super().__init__()
        self.heads, self.dim, self.topk, self.ratio = (cfg.index_n_heads, cfg.index_head_dim,
                                                       cfg.index_topk, ratio)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg, ratio, self.dim)

    def select(self, x: Tensor, qr: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
               keys: Tensor, block_table: Tensor, page: int) -> Tensor:
        """-> entry ids [B, T, topk] (-1 padded), from index keys cached at rows of c*r."""
        B, T, _ = x.shape
        r = self.ratio
        q = self.wq_b(qr).view(B, T, self.heads, self.dim)
        q = apply_rope_tail(q, cos[:, :, None], sin[:, :, None])
        n = block_table.shape[1] * page // r
        c = torch.arange(n, device=x.device)
        k = read_rows(keys, flat_rows(block_table, (c * r).expand(B, n), page))  # [B, n, Di]
        acc = torch.promote_types(x.dtype, torch.float32)
        s = torch.einsum("bthd,bnd->bthn", q.to(acc), k.to(acc)).relu()
        w = self.weights_proj(x).to(acc) * (self.dim ** -0.5 * self.heads ** -0.5)
        score = (s * w[..., None]).sum(2)                                       # [B, T, n]
        visible = c < ((positions + 1) // r).clamp(min=0)[..., None]
        score = score.masked_fill(~visible, float("-inf"))
        # -inf padding to >= topk candidates: a fixed-width top-k for any table width (no shape
        # branch, so export keeps the table width dynamic); padded picks come out as -1.
        score = torch.cat([score, score.new_full((B, T, self.topk), float("-inf"))], -1)
        top = score.topk(self.topk, -1)
        return torch.where(top.values > float("-inf"), top.indices, -1)


class V4Attention(nn.Module):
    def __init__(self, cfg: DeepSeekV4Config, ratio: int):
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.heads, self.groups = H, G        # this rank's (parallel/v4.py splits both by world)
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * D // G, G * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(G * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor = Compressor(cfg, ratio, D) if ratio else None
        self.indexer = Indexer(cfg, ratio) if ratio == 4 else None
        self.kv_format = "auto"               # or mla_fp8.FORMAT (set_kv_format, before make_cache)

    @property
    def inv_freq(self) -> Tensor:
        """[rope_dim / 2] float64, computed where the weights are: a stored tensor would either be
        cast with the weights or stay on the host, and a host tensor inside a CUDA engine becomes
        a device copy that AOTInductor names ``_tensor_constant<i>`` (no weight provides it)."""
        return layer_inv_freq(self.cfg, self.ratio, self.wkv.weight.device)

    # ---- cache ---------------------------------------------------------------------------------
    def make_cache(self, num_pages: int, page: int, dtype, device) -> dict[str, Tensor]:
        """kv [1 | 2, pages + 1, page, D]: latent rows (+ compressed pool); compressor inputs;
        indexer inputs and keys for CSA."""
        D = self.cfg.head_dim
        lead = (2 if self.ratio else 1,)
        c = {"kv": _zeros(num_pages, page, mla_fp8.row_bytes(D, self.cfg.qk_rope_head_dim), torch.uint8,
                          device, lead) if self.fp8_latent else _zeros(num_pages, page, D, dtype, device, lead)}
        if self.compressor is not None:
            c["comp"] = _zeros(num_pages, page, self.compressor.state_dim, dtype, device)
        if self.indexer is not None:
            c["icomp"] = _zeros(num_pages, page, self.indexer.compressor.state_dim, dtype, device)
            c["ikey"] = _zeros(num_pages, page, self.indexer.dim, dtype, device)
        return c

    @property
    def fp8_latent(self) -> bool:
        return self.kv_format == mla_fp8.FORMAT

    def bytes_per_token(self, dtype) -> int:
        size = torch.empty(0, dtype=dtype).element_size()
        row = (mla_fp8.row_bytes(self.cfg.head_dim, self.cfg.qk_rope_head_dim) if self.fp8_latent
               else self.cfg.head_dim * size)
        per = 0
        if self.compressor is not None:
            per += self.compressor.state_dim
        if self.indexer is not None:
            per += self.indexer.compressor.state_dim + self.indexer.dim
        return row * (2 if self.ratio else 1) + per * size

    def _store(self, cache: Tensor, rows: Tensor, latent: Tensor) -> None:
        """Latent rows [..., D] into the cache at flat rows (packed to fp8 rows under fp8_ds_mla)."""
        write_rows(cache, rows, mla_fp8.pack(latent, self.cfg.qk_rope_head_dim) if self.fp8_latent else latent)

    # ---- forward -------------------------------------------------------------------------------
    def rope(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def latent(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, T, d] -> roped latent KV [B, T, D] (also the DSpark context-injection path)."""
        return apply_rope_tail(self.kv_norm(self.wkv(x)), cos, sin)

    def write_context(self, x: Tensor, positions: Tensor, block_table: Tensor, cache: dict) -> None:
        """Write the latent KV of rows x [B, T, d] at positions (-1: nothing) — no query."""
        cos, sin = self.rope(positions, x.dtype)
        self._store(cache["kv"][0], flat_rows(block_table, positions, cache["kv"].shape[2]),
                    self.latent(x, cos, sin))

    def _compress(self, comp: Compressor, x, positions, rows, block_table, state, pool,
                  store=write_rows) -> None:
        page = state.shape[1]
        write_rows(state, rows, comp.inputs(x))
        entry, epos = comp.entries(state, block_table, positions, page, self.inv_freq)
        store(pool, flat_rows(block_table, epos, page), entry)

    def forward(self, x: Tensor, positions: Tensor, block_table: Tensor, cache: dict,
                window_rows: Tensor) -> Tensor:
        """x [B, T, d]; positions [B, T] (-1 inert); window_rows [B, T, W] flat latent rows
        (-1 skip) -> [B, T, d]."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, D, G = self.heads, cfg.head_dim, self.groups
        kv_cache = cache["kv"]
        page = kv_cache.shape[2]
        cos, sin = self.rope(positions, x.dtype)                               # [B, T, rope/2]
        qr = self.q_norm(self.wq_a(x))                                          # [B, T, q_lora]
        q = rms(self.wq_b(qr).view(B, T, H, D), cfg.rms_norm_eps)
        q = apply_rope_tail(q, cos[:, :, None], sin[:, :, None])
        rows = flat_rows(block_table, positions, page)
        self._store(kv_cache[0], rows, self.latent(x, cos, sin))
        idx = window_rows
        if self.ratio:
            r, pool_offset = self.ratio, kv_cache[0].numel() // kv_cache.shape[-1]
            self._compress(self.compressor, x, positions, rows, block_table, cache["comp"],
                           kv_cache[1], self._store)
            if self.indexer is not None:
                self._compress(self.indexer.compressor, x, positions, rows, block_table,
                               cache["icomp"], cache["ikey"])
                ids = self.indexer.select(x, qr, positions, cos, sin, cache["ikey"], block_table, page)
            else:
                # every entry the table can hold, plus one never-visible column: n >= 2 for any
                # table width, so export does not specialise a size-1 dim (P * page < r)
                n = (block_table.shape[1] * page + r - 1) // r + 1
                c = torch.arange(n, device=x.device).expand(B, T, n)
                ids = torch.where(c < ((positions + 1) // r).clamp(min=0)[..., None], c, -1)
            crows = flat_rows(block_table, torch.where(ids >= 0, ids * r, -1).flatten(1), page)
            crows = torch.where(crows >= 0, crows + pool_offset, -1).view(ids.shape)
            idx = torch.cat([window_rows, crows], -1)
        idx = idx.flatten(0, 1).to(torch.int32)                               # [B * T, K]
        if self.fp8_latent:
            kv, idx = mla_fp8.attention_rows(kv_cache.view(-1, kv_cache.shape[-1]), idx, D,
                                             cfg.qk_rope_head_dim, q.dtype)
        else:
            kv = kv_cache.view(-1, D)
        o = sparse_mla_attention_bucketed(q.flatten(0, 1), kv, idx, self.attn_sink.float(), D ** -0.5, D)
        o = apply_rope_tail(o.view(B, T, H, D), cos[:, :, None], sin[:, :, None], inverse=True)
        o = o.reshape(B, T, G, H * D // G)
        o = torch.einsum("btgi,gri->btgr", o, self.wo_a.weight.view(G, cfg.o_lora_rank, -1))
        return self.wo_b(o.flatten(2))


def set_kv_format(model: nn.Module, kv_format: str) -> int:
    """Set every V4 attention's latent cache format in ``model`` (before ``make_cache``) -> how
    many there are; ValueError (nothing set) where the dims do not fit the format."""
    if kv_format not in ("auto", mla_fp8.FORMAT):
        raise ValueError(f"kv_format must be 'auto' or {mla_fp8.FORMAT!r}, got {kv_format!r}")
    mods = [m for m in model.modules() if isinstance(m, V4Attention)]
    for m in mods if kv_format == mla_fp8.FORMAT else []:
        mla_fp8.row_bytes(m.cfg.head_dim, m.cfg.qk_rope_head_dim)            # ValueError: dims unfit
    for m in mods:
        m.kv_format = kv_format
    return len(mods)
