"""A draft over a frequency-ranked sub-vocabulary (FR-Spec; EAGLE-3's draft vocabulary).

The draft's head keeps only the rows of the target's head for ``token_ids`` [Vs] (the most frequent
tokens of a corpus), so the block pass reads Vs / V of the head's bytes (Qwen3-8B: 1.24 GB of a
3.5 GB draft step at V = 151936). The Markov sampler runs over those Vs entries and the proposal
logits z are scattered back to the full vocabulary with -inf elsewhere: q = 0 outside the set.
Verification uses exactly the distribution that was sampled, so the loop stays lossless; what
changes is acceptance, wherever the target puts mass outside the set.

File (``dspark-trt draft-vocab`` writes it, ``draft_vocab_json``): JSON ``{"format": "dspark-draft-vocab", "version": 1,
"vocab_size": V, "token_ids": [...], "source": {...}}``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import ConfigError

FORMAT, VERSION = "dspark-draft-vocab", 1
WIDE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def rank_tokens(counts: Tensor, size: int, always: tuple[int, ...] = ()) -> Tensor:
    """counts [V] -> the ``size`` most frequent token ids (ties: the smaller id), ``always`` (e.g.
    the end-of-sequence ids) among them, ascending int64 [size]."""
    V = counts.shape[0]
    if not 0 < size <= V:
        raise ConfigError(f"draft vocabulary size {size}: must be in 1..{V} (the vocabulary)")
    bad = [t for t in always if not 0 <= t < V]
    if bad:
        raise ConfigError(f"draft vocabulary: token ids {bad} are outside the vocabulary (0..{V - 1})")
    if len(set(always)) > size:
        raise ConfigError(f"draft vocabulary size {size} is smaller than its {len(set(always))} "
                          "required tokens")
    key = counts.double().clone()
    key[list(always)] = float("inf")
    order = torch.sort(-key, stable=True).indices                  # most frequent first, ties by id
    return order[:size].sort().values


def draft_vocab_json(token_ids: Tensor, vocab_size: int, source: dict) -> str:
    """The text of the file ``read_draft_vocab`` reads (``commands/draft_vocab.py`` writes it)."""
    doc = {"format": FORMAT, "version": VERSION, "vocab_size": vocab_size,
           "size": int(token_ids.numel()), "token_ids": [int(t) for t in token_ids], "source": source}
    return json.dumps(doc) + "\n"


def read_draft_vocab(path: str | Path, vocab_size: int | None) -> Tensor:
    """A draft-vocabulary file -> its token ids, ascending int64 [Vs]; ``ConfigError`` naming the
    file and what is wrong (not JSON, another format, another vocabulary, ids out of range or
    repeated, none). ``vocab_size`` None: the file's own (a check before the model loads)."""
    where = f"draft vocabulary {path}"
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (make one with `dspark-trt draft-vocab`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a draft-vocabulary file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{where}: version {doc.get('version')!r}, this build reads version {VERSION}")
    if type(doc.get("vocab_size")) is not int or doc["vocab_size"] <= 0:
        raise ConfigError(f"{where}: \"vocab_size\" must be a positive integer, got {doc.get('vocab_size')!r}")
    vocab_size = doc["vocab_size"] if vocab_size is None else vocab_size
    if doc["vocab_size"] != vocab_size:
        raise ConfigError(f"{where}: made for a vocabulary of {doc.get('vocab_size')} tokens, the "
                          f"model has {vocab_size}")
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise ConfigError(f"{where}: \"token_ids\" must be a non-empty list of integers")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise ConfigError(f"{where}: token ids {out[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: \"token_ids\" repeats ids")
    return torch.tensor(sorted(ids), dtype=torch.int64)


class DraftVocab(nn.Module):
    """The sub-vocabulary's tables: ``token_ids`` [Vs], the Markov head's W2 rows of the set
    [Vs, r], and W1 as [Vs + V, r]: the set's rows (indexed by the sampler's local ids of the
    previous draft), then every token's (indexed by Vs + the anchor, which may be outside the set)."""

    def __init__(self, token_ids: Tensor, w1: Tensor, w2: Tensor):
        super().__init__()
        self.vocab_size = w1.shape[0]
        self.register_buffer("token_ids", token_ids.to(w1.device))
        self.register_buffer("w1", torch.cat([w1[self.token_ids], w1]).detach().clone())
        self.register_buffer("w2", w2[self.token_ids].detach().clone())

    @property
    def key(self) -> str:
        """``<size>-<12 hex digits of the ids' sha256>``: names this set's calibration and cost-curve files."""
        ids = ",".join(str(int(t)) for t in self.token_ids.sort().values.tolist())    # the set, not its order
        return f"{self.token_ids.numel()}-{hashlib.sha256(ids.encode()).hexdigest()[:12]}"

    def markov_inputs(self, anchor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The sampler's anchor (its W1 row: Vs + anchor; inert rows stay < 0), W1 and W2."""
        local = torch.where(anchor >= 0, anchor + self.token_ids.shape[0], anchor)
        return local, self.w1, self.w2

    def w1_rows(self, tokens: Tensor) -> Tensor:
        """W1's rows [..., r] of full-vocabulary token ids [...] (the confidence head's input)."""
        return torch.nn.functional.embedding(tokens + self.token_ids.shape[0], self.w1)

    def to_full(self, drafts: Tensor, z: Tensor, anchor: Tensor,
                z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Local drafts [B, w] and logits [B, w, Vs] -> token ids [B, w] (-1 stays) and logits
        [B, w, V]: -inf outside the set (q = 0), 0 on inert rows (anchor < 0) as the sampler's;
        written into ``z_out`` when given."""
        tokens = torch.where(drafts >= 0, self.token_ids[drafts.clamp(min=0)], -1)
        B, w, _ = z.shape
        fill = torch.where(anchor < 0, 0.0, float("-inf")).to(torch.float32)            # [B]
        full = z.new_empty(B, w, self.vocab_size, dtype=torch.float32) if z_out is None else z_out
        full.copy_(fill[:, None, None].expand(B, w, self.vocab_size))   # one pass; the set's columns next
        full.index_copy_(2, self.token_ids, z.to(full.dtype))           # (inert rows: the sampler's 0)
        return tokens, full


def restrict_draft_vocab_(draft: nn.Module, token_ids: Tensor) -> None:
    """Give ``draft`` (a DSpark Qwen3 or V4 draft) its own head over ``token_ids`` (a copy of the
    target's rows; the target keeps the full head) and the sampler's tables (``DraftVocab``), which
    replace its Markov head (no second copy of W1, no unused full W2: 2 V r values, 156 MB at Qwen3-8B)."""
    name = "lm_head" if hasattr(draft, "lm_head") else "head"
    head = getattr(draft, name)
    if type(head) is not nn.Linear or head.weight.dtype not in WIDE_DTYPES:
        what = f"{type(head).__name__}" + (f" of {head.weight.dtype}" if type(head) is nn.Linear else "")
        raise ConfigError(f"a draft vocabulary needs the draft's head as one plain Linear; it is a {what} "
                          "(tensor-parallel or quantised heads are not supported)")
    V, d = head.weight.shape
    if getattr(draft, "draft_vocab", None) is not None:
        raise ConfigError("the draft already has a draft vocabulary")
    if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= V:
        raise ConfigError(f"draft vocabulary: {token_ids.numel()} token ids, each must be in 0..{V - 1} "
                          f"(the head's rows)")
    if token_ids.unique().numel() != token_ids.numel():        # a repeated id: q twice what z says
        raise ConfigError("draft vocabulary: token ids repeat")
    ids = token_ids.to(head.weight.device)
    w1, w2 = draft.markov_weights()                      # the Markov head's [V, r] (rank 0: [V, 0])
    sub = nn.Linear(d, ids.numel(), bias=False, device=head.weight.device, dtype=head.weight.dtype)
    sub.weight = nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
    setattr(draft, name, sub)
    draft.draft_vocab = DraftVocab(ids, w1, w2)
    draft.markov_head = None       # its tables live on in draft_vocab: W1 whole, W2's rows of the set
