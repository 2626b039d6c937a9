"""``EngineNetworks``: the networks interface (see networks.py) over a built engine directory.

The manifest is checked first (format version, file checksums, GPU, backend/torch version). The
runtime owns the KV caches (allocated from the manifest's cache layout) and passes them to the
compiled networks, which write them in place. The verifier has no weights and runs the
``dspark::rejection_sample`` op directly.

A tensor-parallel engine (manifest ``tp_size`` > 1) holds one ``rank<r>/`` part per rank; each
process of a group of exactly that size loads (and checks the files of) only its own rank's part,
so on several nodes each node needs the shared files and the ``rank<r>/`` parts of its ranks.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .. import plugins
from ..engine.caches import allocate_caches
from ..engine.manifest import EngineError, check_engine, config_from_json
from ..config import ModelPair
from ..config.dtypes import DTYPES
from ..parallel.topology import launch_hint


class EngineNetworks:
    def __init__(self, engine_dir: str | Path, device=None, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, num_pages: int | None = None,
                 verify_checksums: bool = True):
        self.engine_dir = Path(engine_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        m = self.manifest = check_engine(self.engine_dir, self.device, verify_checksums, _group_rank())
        self.tp_size, part = self._rank_part(m)
        s = m["shapes"]
        self.max_batch_size = self._within(max_batch_size, s["max_batch_size"], "max_batch_size")
        self.max_seq_len = self._within(max_seq_len, s["max_seq_len"], "max_seq_len")
        self.num_spec_tokens, self.page_size = s["num_spec_tokens"], s["page_size"]
        self.max_pages_per_seq = s["max_pages_per_seq"]
        pages_per_seq = -(-(self.max_seq_len + self.num_spec_tokens + 1) // self.page_size)
        self.num_pages = num_pages or self.max_batch_size * pages_per_seq
        self.dtype = DTYPES[m["dtype"]]
        self.markov_sampler = m["build_options"].get("markov_sampler", "exact")
        self.draft_vocab_size = (m.get("draft_vocab") or {}).get("size")   # None: the full vocabulary
        self.draft_fp8 = m["build_options"].get("draft_quantization") == "fp8"   # its projections in fp8
        self.pair = ModelPair(m["pair"]["name"], config_from_json(m["pair"]["target"]),
                              config_from_json(m["pair"]["draft"]))
        self.vocab_size = self.pair.target.vocab_size
        self.nets = self._load_networks(m["backend"], part)
        # a draft with a confidence head exports its logits as draft_block's third output
        self.has_confidence = "confidence_logits" in part["networks"]["draft_block"]["outputs"]
        self.target_cache = allocate_caches(part["caches"]["target"], self.num_pages, self.device)
        self.draft_cache = allocate_caches(part["caches"]["draft"], self.num_pages, self.device)

    def _rank_part(self, m: dict) -> tuple[int, dict]:
        """(tp_size, this process's part of the manifest: networks, weights, caches)."""
        tp = m.get("tp_size", 1)
        if tp == 1:
            return 1, m
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != tp:
            raise EngineError(f"{self.engine_dir}: engine built for tp_size={tp} (one part per rank), "
                              f"this process group has WORLD_SIZE={world}: {launch_hint(tp)}")
        return tp, m["ranks"][dist.get_rank()]

    def _within(self, value: int | None, built: int, name: str) -> int:
        if value is not None and value > built:
            raise EngineError(f"{self.engine_dir}: {name}={value} exceeds the {built} the engine was "
                              f"built for; rebuild with --{name.replace('_', '-')} {value}")
        return value or built

    def _load_networks(self, backend: str, m: dict) -> dict:
        nets = m["networks"]
        if backend == "aoti":
            from safetensors.torch import load_file
            from ..engine.networks import load_aoti_network
            weights = load_file(str(self.engine_dir / m["weights"]), device=str(self.device))
            return {name: load_aoti_network(self.engine_dir / n["file"], self.device,
                                            {fqn: weights[w] for fqn, w in n["constants"].items()})
                    for name, n in nets.items()}
        if backend == "tensorrt":
            from ..engine.networks import TensorRTNetwork
            return {name: TensorRTNetwork(self.engine_dir / n["file"], self.device, n["outputs"], n["inputs"])
                    for name, n in nets.items()}
        raise EngineError(f"{self.engine_dir}: unknown backend {backend!r} in the manifest")

    def _check_rows(self, t: Tensor, what: str) -> None:
        if t.shape[0] > self.max_batch_size:
            raise ValueError(f"{what}: batch {t.shape[0]} exceeds the engine's max_batch_size "
                             f"{self.max_batch_size}")

    # ---- the networks interface ----------------------------------------------------------------
    @torch.inference_mode()
    def target(self, tokens: Tensor, positions: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor]:
        """tokens, positions [B, T]; block_table [B, P] -> logits [B, T, V], taps [B, T, m*d]."""
        self._check_rows(tokens, "target")
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"target: {tokens.shape[1]} tokens exceed max_seq_len {self.max_seq_len}")
        logits, taps = self.nets["target"](tokens, positions, block_table, self.target_cache)
        return logits, taps

    @torch.inference_mode()
    def draft_context(self, taps: Tensor, positions: Tensor, block_table: Tensor) -> None:
        self._check_rows(taps, "draft_context")
        self.nets["draft_context"](taps.to(self.dtype), positions, block_table, self.draft_cache)

    @torch.inference_mode()
    def draft_block(self, anchor: Tensor, start: Tensor, block_table: Tensor, temperature: Tensor,
                    seed: Tensor, width: int | None = None, z_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> drafts [B, w] i64, proposal logits z [B, w, V] f32: the first ``width`` (None: all N)
        drafts of the block. N is compiled in, so a window drafts all N and keeps the first w:
        the same tokens and z as a width-w pass (the sampler is sequential, row k reads rows < k
        only), at the whole block's cost. ``z_out``: z copied there."""
        drafts, z = self._draft_block(anchor, start, block_table, temperature, seed)[:2]
        if width is not None and not 1 <= width <= self.num_spec_tokens:
            raise ValueError(f"draft_block: width {width} outside 1..{self.num_spec_tokens} (N)")
        return _window(width, z_out, drafts, z)

    @torch.inference_mode()
    def draft_block_confidence(self, anchor: Tensor, start: Tensor, block_table: Tensor,
                               temperature: Tensor, seed: Tensor, width: int | None = None,
                               z_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """draft_block + the confidence logits [B, w] of the block (the same network call; with
        ``width`` the first w of all N and ``z_out``, as ``draft_block``)."""
        if not self.has_confidence:
            raise EngineError(f"{self.engine_dir}: this engine's draft has no confidence head (its "
                              f"draft_block exports no confidence_logits): use verify mode 'fixed'")
        drafts, z, conf = self._draft_block(anchor, start, block_table, temperature, seed)
        return _window(width, z_out, drafts, z, conf)

    def _draft_block(self, anchor, start, block_table, temperature, seed) -> tuple[Tensor, ...]:
        self._check_rows(anchor, "draft_block")
        return tuple(self.nets["draft_block"](anchor, start, block_table, temperature.to(torch.float32),
                                              seed, self.draft_cache))

    @torch.inference_mode()
    def verify(self, logits: Tensor, drafts: Tensor, draft_logits: Tensor, temperature: Tensor,
               seed: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        return plugins.rejection_sample(logits, drafts, draft_logits, temperature, seed, start)


def _window(width: int | None, z_out: Tensor | None, drafts: Tensor, z: Tensor, *rest: Tensor) -> tuple:
    """The draft outputs (drafts [B, N], z [B, N, V], rest [B, N]) cut to their first ``width`` (None:
    all N) drafts, z copied into ``z_out`` where given."""
    if width is not None and width < drafts.shape[1]:
        drafts, z, rest = drafts[:, :width].contiguous(), z[:, :width], tuple(t[:, :width].contiguous() for t in rest)
    z = z.contiguous() if z_out is None else z_out.copy_(z)
    return (drafts, z, *rest)


def _group_rank() -> int | None:
    """This process's rank in a process group of more than one rank, else None."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() and dist.get_world_size() > 1 else None
