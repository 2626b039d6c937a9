"""User-facing API: ``LLM(...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch

from ..config import ModelPair, get_preset
from ..models import build_models
from .generator import Generator, to_output
from .networks import EagerNetworks
from .sampling_params import RequestError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    """Target + DSpark draft with their caches, ready to generate.

    Build it with ``LLM.from_preset``, ``LLM.from_checkpoints`` or ``LLM.from_engine``.
    """

    def __init__(self, pair: ModelPair, target, draft, *, networks=None, tokenizer=None,
                 max_batch_size: int = 8, max_seq_len: int = 2048, page_size: int = 64,
                 num_pages: int | None = None, device=None, dtype=None):
        self.pair, self.target, self.draft = pair, target, draft
        self.tokenizer = tokenizer
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        p = next(target.parameters()) if target is not None else None
        self.device = torch.device(device or (p.device if p is not None else "cpu"))
        self.dtype = dtype or (p.dtype if p is not None else torch.float32)
        n = draft.num_spec_tokens if draft is not None else 0
        if num_pages is None:     # enough for every sequence of a full batch at max_seq_len
            num_pages = max_batch_size * -(-(max_seq_len + n + 1) // page_size)
        self.networks = networks or EagerNetworks(target, draft, num_pages, page_size,
                                                  self.device, self.dtype)

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, *, seed: int = 0, dtype=torch.float32, device=None,
                    num_spec_tokens: int | None = None, **kw) -> "LLM":
        """Random weights with the preset's dimensions (acceptance will be near 1)."""
        pair = get_preset(name)
        device = device or default_device()
        target, draft = build_models(pair, dtype, device, num_spec_tokens, seed)
        return cls(pair, target, draft, device=device, dtype=dtype, **kw)

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, draft_dir: str | Path, *, dtype=torch.float32,
                         device=None, num_spec_tokens: int | None = None, **kw) -> "LLM":
        from ..builder.loaders import load_pair
        device = device or default_device()
        pair, target, draft = load_pair(target_dir, draft_dir, dtype, device, num_spec_tokens)
        tok = kw.pop("tokenizer", None) or load_tokenizer(target_dir)
        return cls(pair, target, draft, tokenizer=tok, device=device, dtype=dtype, **kw)

    @classmethod
    def from_engine(cls, engine_dir: str | Path, *, device=None, max_batch_size: int | None = None,
                    max_seq_len: int | None = None, **kw) -> "LLM":
        """Load an engine directory built by ``dspark-trt build`` (manifest checked first)."""
        from .engine import EngineNetworks
        nets = EngineNetworks(engine_dir, device=device, max_batch_size=max_batch_size,
                              max_seq_len=max_seq_len, num_pages=kw.pop("num_pages", None))
        tok = kw.pop("tokenizer", None) or load_tokenizer(engine_dir)
        return cls(nets.pair, None, None, networks=nets, tokenizer=tok,
                   max_batch_size=nets.max_batch_size, max_seq_len=nets.max_seq_len,
                   page_size=nets.page_size, num_pages=nets.num_pages, device=nets.device,
                   dtype=nets.dtype, **kw)

    # ---- generation ------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompt given but this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt).ids
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None

    def generator(self, speculative: bool = True) -> Generator:
        """A fresh scheduler over this model's caches (continuous batching: add_request + step)."""
        return Generator(self.networks, self.max_batch_size, self.max_seq_len,
                         self.pair.target.vocab_size, self.pair.target.eos_token_id, speculative)

    def generate(self, prompts: str | Seq[int] | list, params: SamplingParams | list | None = None,
                 speculative: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        gen = self.generator(speculative)
        outs = gen.run([(self.encode(p), sp) for p, sp in zip(prompts, plist)])
        for o in outs:
            o.text = self.decode(o.output_ids)
        return outs

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               speculative: bool = True) -> Iterator[list[int]]:
        """Yield lists of new token ids as rounds commit them."""
        gen = self.generator(speculative)
        chunks: list[list[int]] = []
        gen.add_request(self.encode(prompt), params or SamplingParams(), on_tokens=chunks.append)
        while gen.has_work():
            gen.step()
            while chunks:
                yield chunks.pop(0)


def load_tokenizer(ckpt_dir: str | Path):
    path = Path(ckpt_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


__all__ = ["LLM", "SamplingParams", "RequestOutput", "to_output"]
