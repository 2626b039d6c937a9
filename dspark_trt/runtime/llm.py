"""User-facing API: ``LLM(...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..config import ConfigError, ModelPair, get_preset
from ..config.checks import read_json
from ..config.dtypes import stored_dtype
from ..config.source import (DEFAULT_ASSETS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, FALLBACK_PRESET,
                             ModelSource, default_pair_dirs, resolve_num_spec_tokens)
from ..devices import default_device, resolve_device, resolve_dtype  # noqa: F401  (default_device: re-exported)
from ..checkpoints.files import CALIBRATION_FILE, COST_FILE, draft_sidecar, sidecar_mismatch
from ..checkpoints.prepare import prepare_models
from ..models.dspark_qwen3 import markov_sampler_op
from ..models.qwen3 import use_row_kernels_
from ..parallel import TPInfo, init_tp, shared_seeds
from ..parallel.topology import launch_hint
from ..plugins.decode_linear import skinny_gemm_enabled, use_decode_linear_
from ..models.fuse import use_skinny_gemm_fused_
from .compiled import compile_backend, compile_regions_, mark_caches_static
from .confidence import Calibration
from .cost_curve import CostCurve
from .verify_scheduler import COST_MODELS, VerifyScheduler
from .cuda_graphs import GraphedSteps, graphs_unavailable_reason
from .kv_manager import (KVBudgetError, check_kv_fits, context_that_fits, cuda_kv_budget,
                         kv_bytes_per_token, pages_from_budget, table_width_cost)
from .networks import EagerNetworks, decode_chain_flag, row_kernels_flag
from .prompts import check_text, is_single_prompt, token_ids
from .sampling_params import RequestError, RequestOutput, SamplingParams, StreamChunk
from .scheduler import Scheduler, to_output
from .steps import DecodeSteps

log = logging.getLogger(__name__)


def check_engine_sampler(built: str, mode: str | None) -> None:
    """An engine has its draft sampler compiled in: asking for another one is an error."""
    if mode is not None and built != mode:
        from ..engine.manifest import EngineError
        raise EngineError(f"this engine samples drafts with markov_sampler={built!r} (compiled in); "
                          f"rebuild with `dspark-trt build --markov-sampler {mode}` to use {mode!r}")


RANDOM_WEIGHTS_NOTE = "acceptance will be low, tau near 1; text is noise"


class LLM:
    """Target + DSpark draft with their caches, ready to generate.

    Build it with ``LLM.from_source`` (a ``config.ModelSource``: what the CLI and serving give),
    ``LLM.from_preset``, ``LLM.from_checkpoints`` or ``LLM.from_engine``.

    KV cache size: ``num_pages`` explicitly, or from a memory budget (``kv_cache_bytes``, or
    ``gpu_memory_utilization`` of the GPU minus what is in use), or by default enough pages for
    ``max_batch_size`` sequences of ``max_seq_len`` (of min(context, 2048) when it is not given).
    ``max_seq_len`` defaults to the model's context (a larger one is refused), capped to what the
    pages hold for one sequence, and to 2048 where a wide block table costs every step (a CPU,
    DeepSeek-V4: ``kv_manager.table_width_cost``); a cap is logged with its reason. ``dtype``
    of the constructors: "auto" (default, ``devices.resolve_dtype``), a ``DTYPES`` name or a
    torch dtype. ``cuda_graphs``: replay the decode steps from
    CUDA graphs per batch bucket (default: on for CUDA; on CPU they are skipped, with the reason in
    ``graphs_skipped``); ``graph_backend``: "cuda-python" (default when installed) or "torch".

    Tensor parallelism (``tp_size`` of the constructors, one process per rank under torchrun):
    the modules are sharded by ``parallel.shard_pair_`` (``expert_parallel``: MoE experts split
    by expert instead of by intermediate dim); every rank runs this same scheduler on the same
    inputs. Requests without a seed get one drawn on rank 0 and broadcast. Modules sharded by hand
    come with ``tp`` (their ``parallel.TPInfo``): the world is an argument, not module state.

    ``num_spec_tokens``: N drafts per round (default: the draft's trained ``block_size``; an
    engine's is compiled in). N, the sampler mode and the TP world are held by this object and
    its networks and passed to the modules' forwards; the modules hold weights and shapes only.

    ``markov_sampler``: "exact" (default, the full-vocabulary Markov sampler) or "topk" (fast,
    candidate-restricted proposal; lossless, see ``models.dspark_qwen3.markov_sampler_op``). An
    engine has its sampler compiled in (``dspark-trt build --markov-sampler``).

    Confidence modes (``SamplingParams.verify_mode``; ``runtime/confidence.py``): need a draft with
    a confidence head. ``calibration`` (STS temperatures) and ``verify_cost`` (the cost curve of the
    scheduler) default to ``confidence_calibration.json`` / ``verify_cost.json`` found in the draft
    checkpoint or engine directory (none: uncalibrated, the default curve). ``learn_round_costs``
    (opt-in): the AR fallback of scheduled batches scales the curve's prices by what its rounds
    cost as they run (``runtime/round_costs.py``; never under tensor parallelism).
    ``cost_model``: how scheduled rounds verify their admitted drafts (``VerifyScheduler``): "trimmed"
    (the default: one window for the batch, narrowed to what the rounds admit), "packed" (each row
    its own prefix, packed; Qwen3-family targets), "auto" (packed from ``PACKED_MIN_ROWS`` rows,
    trimmed below) or "padded". "auto" was the default where the target packs until session 41: on
    an H100 at Qwen3-8B dimensions (8952a71, batch 64, 256 tokens) trimmed rounds ran 1.32-1.34x
    fixed N against auto's packed 1.21-1.27x, and 1.07-1.08x AR against 0.98-1.04x.

    Eager modules (presets, checkpoints) get fused q/k/v and gate/up projections as engines do
    (``fuse=False`` in ``from_preset`` / ``from_checkpoints``: the separate HF linears).
    ``compile``: True (inductor) or a torch.compile backend name: compile the decoder layers and
    norms in place (``runtime/compiled.py``), replayed inside the same CUDA graphs; engines are
    compiled already (refused).
    """

    def __init__(self, pair: ModelPair, target, draft, *, networks=None, tokenizer=None,
                 max_batch_size: int = 8, max_seq_len: int | None = None, page_size: int = 64,
                 num_pages: int | None = None, device=None, dtype=None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                 cuda_graphs: bool | None = None, graph_backend: str | None = None,
                 markov_sampler: str | None = None, calibration: Calibration | None = None,
                 verify_cost: CostCurve | None = None, num_spec_tokens: int | None = None,
                 tp: TPInfo | None = None, compile: bool | str = False, kv_cache_dtype: str = "auto",
                 learn_round_costs: bool = False, cost_model: str = "trimmed"):
        self.pair, self.target, self.draft = pair, target, draft
        if cost_model not in COST_MODELS:
            raise ConfigError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
        self.kv_cache_dtype = set_kv_cache_dtype(kv_cache_dtype, target, draft, networks)
        self.compiled = compile_backend(compile)
        if self.compiled and networks is not None:
            raise ConfigError("compile applies to eager modules; an engine's networks are compiled already")
        pair.check_limits(max_batch_size, max_seq_len)
        if markov_sampler is not None:
            markov_sampler_op(markov_sampler)                 # validates the name
            if networks is not None:                         # an engine: compiled in
                check_engine_sampler(getattr(networks, "markov_sampler", "exact"), markov_sampler)
        self.tokenizer = tokenizer
        context = getattr(pair.target, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
        self.max_batch_size = max_batch_size
        self.tp_size = tp.world if tp is not None else getattr(networks, "tp_size", 1)
        self.tp_rank = tp.rank if tp is not None else (torch.distributed.get_rank() if self.tp_size > 1 else 0)
        p = next(target.parameters()) if target is not None else None
        self.device = torch.device(device or (p.device if p is not None else "cpu"))
        self.dtype = dtype or (p.dtype if p is not None else torch.float32)
        n = (networks.num_spec_tokens if networks is not None
             else resolve_num_spec_tokens(num_spec_tokens, draft.config) if draft is not None else 0)
        if num_pages is None:       # a full batch of max_seq_len, or of the default KV length
            seq = max_seq_len or min(context, DEFAULT_MAX_SEQ_LEN)
            num_pages = self._pages_from_budget(kv_cache_bytes, gpu_memory_utilization, page_size, n,
                                                seq, max_seq_len or 1)
        if max_seq_len is None:     # the model's context, as far as the KV pages hold one sequence
            width_cost = table_width_cost(pair, self.device) if networks is None else None
            max_seq_len = context_that_fits(context, num_pages, page_size, n + 1, width_cost,
                                            DEFAULT_MAX_SEQ_LEN)
        self.max_seq_len = max_seq_len
        self.max_pages_per_seq = -(-(max_seq_len + n + 1) // page_size)
        if networks is None:
            check_kv_fits(num_pages, page_size, self._kv_bytes_per_token(n > 0), self.device)
        mods = [m for m in (target, draft) if m is not None] if networks is None else []
        if mods and skinny_gemm_enabled():                   # opt-in Triton decode GEMMs (issue #21)
            for m in mods:
                use_decode_linear_(m), use_skinny_gemm_fused_(m)
        if self.compiled and self.tp_size > 1:
            raise ConfigError("compile is not supported under tensor parallelism yet (the layers' "
                              "collectives are untested under torch.compile); run without it")
        if self.compiled == "inductor" and self.device.type == "cpu":
            log.warning("compile=True on CPU: inductor compiles C++ for every new shape class (minutes "
                        "for the first steps); compile='aot_eager' only traces")
        for m in mods if self.compiled else []:
            compile_regions_(m, self.compiled)
        self.networks = networks or EagerNetworks(target, draft, num_pages, page_size,
                                                  self.device, self.dtype, markov_sampler, n)
        chain = decode_chain_flag()
        # "auto" beside compiled modules too (H100 at f9411cd, Qwen3-8B dims: AR 6.17 ms against
        # the compiled modules' 6.65 at batch 1, 7.48 / 7.41 at batch 16; verify and draft no slower)
        if networks is None and chain and (chain != "auto" or self.device.type == "cuda"):
            from .token_step import chain_for           # Triton kernels: imported only where they may run
            self.networks.decode_chain = chain_for(target, self.device, self.tp_size)   # (issue #21)
            self.networks.draft_chain = None if draft is None else chain_for(draft, self.device, self.tp_size)
        if networks is None and self.device.type == "cuda" and not self.compiled and self.tp_size == 1 \
                and row_kernels_flag():          # the eager steps past the chain's rows (issue #21)
            for m in (target, draft):            # the draft's block passes of more than 16 rows too
                if m is not None:
                    use_row_kernels_(m)
        if self.compiled:
            mark_caches_static(self.networks.target_cache, self.networks.draft_cache)
        self.graphs_skipped = graphs_unavailable_reason(self.networks.device)
        if cuda_graphs and self.graphs_skipped:
            log.warning("CUDA graphs skipped: %s (running the steps eagerly)", self.graphs_skipped)
        if cuda_graphs is False:
            self.graphs_skipped = "disabled (cuda_graphs=False)"
        if self.tp_size > 1 and not cuda_graphs and not self.graphs_skipped:
            self.graphs_skipped = "tensor parallel: collectives are not captured by default (cuda_graphs=True to try)"
        self.graph_backend = graph_backend
        self.calibration, self.verify_cost = calibration, verify_cost or CostCurve.default()
        # the AR fallback scales its prices by the rounds' observed walls (round_costs.py); not
        # under tensor parallelism: every rank must take the same decision
        self.learn_round_costs = learn_round_costs and self.tp_size == 1
        if cost_model in ("packed", "auto") and not getattr(self.networks, "packs_rows", False):
            raise ConfigError(f"cost_model {cost_model!r} packs each row's admitted prefix into one verify; "
                              f"this target cannot (packing needs a Qwen3-family target's eager modules: "
                              f"a preset or checkpoints, not an engine or DeepSeek-V4): use 'trimmed' or "
                              f"'padded'")
        self.cost_model = cost_model
        self._steps = None

    def _pages_from_budget(self, kv_cache_bytes, gpu_memory_utilization, page_size: int, n: int,
                           seq_tokens: int, min_tokens: int) -> int:
        """KV pages: ``max_batch_size`` sequences of ``seq_tokens`` (+ the speculative headroom)
        without a budget, else what the budget holds (at least one sequence of ``min_tokens``)."""
        full = self.max_batch_size * -(-(seq_tokens + n + 1) // page_size)
        if kv_cache_bytes is None and gpu_memory_utilization is None:
            return full
        if kv_cache_bytes is not None and gpu_memory_utilization is not None:
            raise KVBudgetError("give kv_cache_bytes or gpu_memory_utilization, not both")
        if kv_cache_bytes is None:
            if self.device.type != "cuda":
                raise KVBudgetError(f"gpu_memory_utilization needs a CUDA device, the model is on "
                                    f"'{self.device}'; give kv_cache_bytes or num_pages")
            kv_cache_bytes = cuda_kv_budget(self.device, gpu_memory_utilization)
        per_token = self._kv_bytes_per_token(n > 0)
        pages = pages_from_budget(kv_cache_bytes, page_size, per_token, min_tokens + n + 1)
        if pages < full:
            log.warning("KV budget holds %d pages; a full batch of %d sequences of %d tokens needs "
                        "%d: fewer will run at once", pages, self.max_batch_size, seq_tokens, full)
        log.info("KV cache: %d pages of %d tokens (%.2f GiB)", pages, page_size,
                 pages * page_size * per_token / 2**30)
        return pages

    def _kv_bytes_per_token(self, speculative: bool) -> int:
        """Cache bytes per token on this rank: the modules' own count when they give one (V4:
        the shared latent is replicated on every rank), else the pair's K/V heads / tp_size."""
        mods = [self.target] + ([self.draft] if speculative and self.draft is not None else [])
        if all(hasattr(m, "kv_bytes_per_token") for m in mods):
            return sum(m.kv_bytes_per_token(self.dtype) for m in mods)
        return kv_bytes_per_token(self.pair, self.dtype, speculative) // self.tp_size

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_source(cls, src: ModelSource, *, say: Callable[[str], None] = print, **kw) -> "LLM":
        """From ``src``: its engine, its checkpoint pair, its preset (random weights), or else the
        built-in default pair (the fallback preset without one); ``say`` tells which, and on a CPU
        which dtype "auto" picked and why (``devices.resolve_dtype``). The device, dtype and
        preset name are checked before anything loads (``ConfigError``)."""
        device = str(resolve_device(src.device))
        resolve_dtype(src.dtype, device)                  # a bad name fails before anything loads
        if src.draft_vocab and not src.engine:            # so does a bad draft-vocabulary file
            from ..checkpoints.prepare import check_draft_vocab
            check_draft_vocab(src.draft_vocab, src.tp_size)
        kw.update(max_batch_size=src.max_batch_size, max_seq_len=src.max_seq_len,
                  markov_sampler=src.markov_sampler)
        if src.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = src.kv_cache_dtype
        kw.setdefault("cost_model", src.verify_cost_model)
        fuse = kw.pop("fuse", True)                       # engines are fused at build time
        if src.engine:                                    # the engine's own dtype
            if src.draft_quantization not in (None, "none"):
                raise ConfigError(f"--draft-quantization {src.draft_quantization}: an engine's draft weights are "
                                  "compiled in (`dspark-trt build --draft-quantization`)")
            if src.draft_vocab:
                raise ConfigError(f"--draft-vocab {src.draft_vocab}: an engine's draft vocabulary is "
                                  "compiled in (`dspark-trt build --draft-vocab`)")
            return cls.from_engine(src.engine, device=device, tp_size=src.tp_size,
                                   num_spec_tokens=src.num_spec_tokens, **kw)
        kw["max_batch_size"] = kw["max_batch_size"] or DEFAULT_MAX_BATCH_SIZE
        if src.expert_parallel and src.tp_size == 1:
            raise ConfigError("--expert-parallel needs --tp-size > 1 (under torchrun)")
        if src.checkpoint or src.draft_checkpoint:
            if not (src.checkpoint and src.draft_checkpoint):
                raise ConfigError("--checkpoint and --draft-checkpoint go together")
            dirs = (src.checkpoint, src.draft_checkpoint)
        elif src.model is None and default_pair_dirs() is not None:
            dirs = default_pair_dirs()
        else:
            dirs = None
        dtype, note = resolve_dtype(src.dtype, device, checkpoint_dtype(dirs[0]) if dirs else None)
        kw.update(dtype=dtype, device=device, num_spec_tokens=src.num_spec_tokens, tp_size=src.tp_size,
                  expert_parallel=src.expert_parallel, quantization=src.quantization, fuse=fuse,
                  draft_vocab=src.draft_vocab, draft_quantization=src.draft_quantization)
        if dirs is not None:
            if not (src.checkpoint or src.draft_checkpoint):
                say(f"[dspark-trt] using the built-in default pair ({DEFAULT_ASSETS})")
            llm = cls.from_checkpoints(*dirs, **kw)
        else:
            name = src.model or FALLBACK_PRESET
            get_preset(name).check_limits(kw["max_batch_size"], kw["max_seq_len"])   # before the notice
            say(f"[dspark-trt] no checkpoint given: preset '{name}' with RANDOM weights on {device} "
                f"({RANDOM_WEIGHTS_NOTE})")
            llm = cls.from_preset(name, **kw)
        if note:
            say(note)                                     # which dtype a CPU run uses, and why
        return llm

    @classmethod
    def from_preset(cls, name: str, *, seed: int = 0, dtype="auto", device=None,
                    num_spec_tokens: int | None = None, tp_size: int = 1,
                    expert_parallel: bool = False, quantization: str | None = None, fuse: bool = True,
                    draft_vocab: str | None = None, draft_quantization: str | None = None, **kw) -> "LLM":
        """Random weights with the preset's dimensions (acceptance will be low: tau near 1).
        ``dtype``: a torch dtype, a ``DTYPES`` name or "auto" (the device's default: bf16 on CUDA,
        fp32 on a CPU); ``quantization``: ``ModelSource.quantization``; ``fuse``: one GEMM for
        q/k/v and one for gate/up (as engines); ``draft_vocab``: a draft-vocabulary file
        (``ModelSource.draft_vocab``); ``draft_quantization``: ``ModelSource.draft_quantization``."""
        pair = get_preset(name)
        pair.check_limits(kw.get("max_batch_size"), kw.get("max_seq_len"))
        device, tp = _join_tp(tp_size, device)
        dtype = _auto_dtype(dtype, device, None)
        src = ModelSource(model=name, expert_parallel=expert_parallel, quantization=quantization,
                          draft_vocab=draft_vocab, draft_quantization=draft_quantization)
        pair, target, draft = prepare_models(src, dtype, device, tp, pair=pair, seed=seed, fuse=fuse)
        return cls(pair, target, draft, device=device, dtype=dtype, num_spec_tokens=num_spec_tokens,
                   tp=tp, **kw)

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, draft_dir: str | Path, *, dtype="auto",
                         device=None, num_spec_tokens: int | None = None, tp_size: int = 1,
                         expert_parallel: bool = False, quantization: str | None = None,
                         fuse: bool = True, draft_vocab: str | None = None, draft_quantization: str | None = None,
                         **kw) -> "LLM":
        """With ``tp_size`` > 1 the full weights load on the host, and each rank moves only its
        shard to its device. ``dtype``: a torch dtype, a ``DTYPES`` name or "auto" (the target
        config.json's ``torch_dtype``; bf16 / fp16 run in fp32 on a CPU, ``devices.resolve_dtype``);
        ``quantization``: ``ModelSource.quantization``; ``fuse``, ``draft_vocab``, ``draft_quantization``:
        as ``from_preset``."""
        device, tp = _join_tp(tp_size, device)
        dtype = _auto_dtype(dtype, device, checkpoint_dtype(target_dir))
        src = ModelSource(checkpoint=str(target_dir), draft_checkpoint=str(draft_dir),
                          expert_parallel=expert_parallel, quantization=quantization, draft_vocab=draft_vocab,
                          draft_quantization=draft_quantization)
        pair, target, draft = prepare_models(src, dtype, device, tp, fuse=fuse)
        tok = kw.pop("tokenizer", None) or load_tokenizer(target_dir)
        kw.setdefault("calibration", _draft_sidecar(Calibration.find, CALIBRATION_FILE, draft_dir, draft))
        kw.setdefault("verify_cost", _draft_sidecar(CostCurve.find, COST_FILE, draft_dir, draft))
        return cls(pair, target, draft, tokenizer=tok, device=device, dtype=dtype,
                   num_spec_tokens=num_spec_tokens, tp=tp, **kw)

    @classmethod
    def from_engine(cls, engine_dir: str | Path, *, device=None, max_batch_size: int | None = None,
                    max_seq_len: int | None = None, tp_size: int | None = None,
                    num_spec_tokens: int | None = None, **kw) -> "LLM":
        """Load an engine directory built by ``dspark-trt build`` (manifest checked first). A
        tensor-parallel engine joins the torchrun group (its size must be the engine's tp_size;
        ``tp_size``, when given, must match too). ``num_spec_tokens`` and ``markov_sampler`` are
        compiled in: when given they must be the engine's."""
        from ..engine.manifest import EngineError, read_manifest
        from .engine import EngineNetworks
        device = resolve_device(device)
        manifest = read_manifest(engine_dir)
        built_n = manifest.get("shapes", {}).get("num_spec_tokens")
        if num_spec_tokens is not None and num_spec_tokens != built_n:
            raise EngineError(f"{engine_dir}: the engine was built with num_spec_tokens={built_n} "
                              f"(compiled into its draft); omit --num-spec-tokens, or rebuild with "
                              f"`dspark-trt build --num-spec-tokens {num_spec_tokens}`")
        check_engine_sampler(manifest.get("build_options", {}).get("markov_sampler", "exact"),
                             kw.get("markov_sampler"))
        built = manifest.get("tp_size", 1)
        if tp_size is not None and tp_size != built:
            raise EngineError(f"{engine_dir}: engine built for tp_size={built}, asked for "
                              f"tp_size={tp_size}: {launch_hint(built)}; or rebuild with --tp-size {tp_size}")
        if built > 1:
            tp = init_tp(device_type=device.type)
            device = tp.device if tp.world == built else device
        nets = EngineNetworks(engine_dir, device=device, max_batch_size=max_batch_size,
                              max_seq_len=max_seq_len, num_pages=kw.pop("num_pages", None))
        tok = kw.pop("tokenizer", None) or load_tokenizer(engine_dir)
        kw.setdefault("calibration", Calibration.find(engine_dir))
        kw.setdefault("verify_cost", CostCurve.find(engine_dir))
        return cls(nets.pair, None, None, networks=nets, tokenizer=tok,
                   max_batch_size=nets.max_batch_size, max_seq_len=nets.max_seq_len,
                   page_size=nets.page_size, num_pages=nets.num_pages, device=nets.device,
                   dtype=nets.dtype, **kw)

    # ---- generation ------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Text (needs a tokenizer) or token ids (a sequence of ints, or a 1-D integer numpy array
        or tensor) -> token ids; ``RequestError`` otherwise."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompt given but this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(check_text(prompt)).ids
        return token_ids(prompt)

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None

    @property
    def steps(self):
        """The decode steps every scheduler shares: CUDA graphs (captured lazily) or eager."""
        if self._steps is None:
            n = self.networks.num_spec_tokens
            sched = VerifyScheduler(n, self.max_batch_size * (n + 1), self.networks.device,
                                    self.calibration, self.verify_cost, cost_model=self.cost_model,
                                    learn_costs=self.learn_round_costs) if n else None
            eager = DecodeSteps(self.networks, sched)
            self._steps = eager if self.graphs_skipped else GraphedSteps(
                eager, self.max_batch_size, self.max_pages_per_seq, self.graph_backend)
        return self._steps

    def capture_graphs(self, speculative: bool = True, prefill_lengths: list[int] | None = None) -> None:
        """Capture every batch bucket now (otherwise each is captured on first use); with
        ``prefill_lengths``, the admission prefill's graphs of prompts that long too."""
        if isinstance(self.steps, GraphedSteps):
            self.steps.capture(speculative, prefill_lengths=prefill_lengths)

    def scheduler(self, speculative: bool = True, record_confidence: bool = False) -> Scheduler:
        """A fresh scheduler over this model's caches (continuous batching: add_request + step)."""
        return Scheduler(self.networks, self.max_batch_size, self.max_seq_len,
                         self.pair.target.vocab_size, self.pair.target.eos_token_id, speculative,
                         steps=self.steps, record_confidence=record_confidence)

    def generator(self, speculative: bool = True, record_confidence: bool = False) -> Scheduler:
        """Deprecated alias of ``scheduler()`` (removed in the next release)."""
        warnings.warn("LLM.generator() is deprecated; use LLM.scheduler()", DeprecationWarning,
                      stacklevel=2)
        return self.scheduler(speculative, record_confidence)

    def generate(self, prompts: str | Seq[int] | list, params: SamplingParams | list | None = None,
                 speculative: bool = True,
                 on_chunk: Callable[[StreamChunk], None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text or token ids); outputs in prompt order.
        ``on_chunk`` is called with every ``StreamChunk`` as rounds commit tokens."""
        prompts, plist = self._requests(prompts, params)
        gen = self.scheduler(speculative)
        seqs = [gen.add_request(self.encode(p), sp) for p, sp in zip(prompts, plist)]
        for chunk in self._drive(gen, seqs):
            if on_chunk is not None:
                on_chunk(chunk)
        outs = [to_output(s) for s in seqs]
        for o in outs:
            o.text = self.decode(o.output_ids)
        return outs

    def stream_batch(self, prompts: list, params: SamplingParams | list | None = None,
                     speculative: bool = True) -> Iterator[StreamChunk]:
        """Run several requests concurrently; yield ``StreamChunk``s as rounds commit tokens.
        Requests are validated here, before the first chunk (a bad one raises ``RequestError``)."""
        prompts, plist = self._requests(prompts, params)
        gen = self.scheduler(speculative)
        seqs = [gen.add_request(self.encode(p), sp) for p, sp in zip(prompts, plist)]
        return self._drive(gen, seqs)

    def _requests(self, prompts, params) -> tuple[list, list[SamplingParams]]:
        if is_single_prompt(prompts):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return list(prompts), self._tp_seeded(plist)

    def _tp_seeded(self, plist: list[SamplingParams]) -> list[SamplingParams]:
        """Under tensor parallelism every rank must sample alike: unseeded requests get seeds
        drawn on rank 0 and broadcast (one collective, on every rank)."""
        if self.tp_size == 1:
            return plist
        seeds = shared_seeds(len(plist), self.device)
        return [sp if sp.seed is not None else dataclasses.replace(sp, seed=s)
                for sp, s in zip(plist, seeds)]

    @staticmethod
    def _drive(gen: Scheduler, seqs: list) -> Iterator[StreamChunk]:
        """Step ``gen`` to completion, yielding each sequence's new tokens; the last chunk of a
        sequence carries its finish reason."""
        index = {s.request_id: i for i, s in enumerate(seqs)}
        pending: list[StreamChunk] = []
        for s in seqs:
            s.on_tokens = (lambda rid: lambda toks: pending.append(
                StreamChunk(index[rid], rid, list(toks))))(s.request_id)
        while gen.has_work():
            done = gen.step()
            for s in done:
                last = next((c for c in reversed(pending) if c.request_id == s.request_id), None)
                if last is None:
                    pending.append(last := StreamChunk(index[s.request_id], s.request_id, []))
                last.finish_reason, last.error = s.finish_reason, s.error
            yield from pending
            pending.clear()

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               speculative: bool = True) -> Iterator[list[int]]:
        """Yield lists of new token ids as rounds commit them."""
        gen = self.scheduler(speculative)
        chunks: list[list[int]] = []
        params = self._tp_seeded([params or SamplingParams()])[0]
        gen.add_request(self.encode(prompt), params, on_tokens=chunks.append)
        while gen.has_work():
            gen.step()
            while chunks:
                yield chunks.pop(0)


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype | None:
    """The dtype the checkpoint's config.json stores its weights in (None: not said)."""
    path = Path(ckpt_dir) / "config.json"
    return stored_dtype(read_json(path)) if path.exists() else None


def _draft_sidecar(find, plain: str, draft_dir, draft):
    """``find`` (``Calibration.find``, ``CostCurve.find``) of this draft's own sidecar file beside it
    (a draft vocabulary's, ``draft_sidecar``); one made without the set is not used, and the log
    says so."""
    if why := sidecar_mismatch(draft_dir, plain, draft):
        log.warning(why)
    return find(draft_dir, name=draft_sidecar(plain, draft))


def _auto_dtype(dtype, device: torch.device, stored: torch.dtype | None) -> torch.dtype:
    """``resolve_dtype`` for the Python constructors: its note goes to the log."""
    dtype, note = resolve_dtype(dtype, str(device), stored)
    if note:
        log.info(note.removeprefix("[dspark-trt] "))
    return dtype


def _join_tp(tp_size: int, device) -> tuple[torch.device, TPInfo | None]:
    """(the device of this rank, its ``TPInfo``): joins the torchrun process group for
    ``tp_size`` > 1 (a single process: ``device`` resolved, None)."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    device = resolve_device(device)
    if tp_size == 1:
        return device, None
    if device.index is not None:
        raise ConfigError(f"device {str(device)!r} with tp_size={tp_size}: each rank uses "
                          "cuda:LOCAL_RANK of its node; give 'cuda' (select the GPUs with CUDA_VISIBLE_DEVICES)")
    tp = init_tp(device_type=device.type, tp_size=tp_size)     # checks WORLD_SIZE, LOCAL_RANK, GPUs
    return tp.device, tp


def load_tokenizer(ckpt_dir: str | Path):
    path = Path(ckpt_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


__all__ = ["LLM", "SamplingParams", "RequestOutput", "to_output"]


KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")


def set_kv_cache_dtype(name: str, target, draft, networks) -> str:
    """Apply ``kv_cache_dtype`` to the eager modules before their caches exist: "auto" (the
    model's dtype) or "fp8_ds_mla" (DeepSeek-V4 MLA latent rows in fp8, ``models/mla_fp8.py``);
    ``ConfigError`` naming what does not fit."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if networks is not None:
        if name != "auto":
            raise ConfigError(f"kv_cache_dtype {name!r}: engines keep the cache layout they were built "
                              f"with (bf16 latent rows); use the eager modules (LLM.from_preset / "
                              f"from_checkpoints)")
        return name
    from ..models.v4_attention import set_kv_format
    try:
        mla = [set_kv_format(m, name) for m in (target, draft) if m is not None]   # "auto" resets
    except ValueError as e:
        raise ConfigError(f"kv_cache_dtype {name!r}: {e}") from None
    if name != "auto" and not (mla and mla[0]):
        raise ConfigError(f"kv_cache_dtype {name!r} is the DeepSeek MLA latent layout; this target "
                          f"({type(target).__name__}) has no MLA attention")
    return name
