"""CUDA graphs of the decode steps, captured per batch-size bucket and replayed each round.

``GraphedSteps`` has the interface of ``DecodeSteps`` (``spec_round``, ``ar_round``). Per bucket
``Bb`` (1, 2, 4, 8, 16, 32, 64 ... up to max_batch_size) it owns one static input buffer (anchor,
start, seed, verify mode, table, temperature, top_p, threshold, and the modifier fields top_k,
min_p, penalties, slot) and lazily captures three graphs on it: the draft step, the verify step and
the autoregressive step, the last two keyed by the round's ``Modifiers`` (which of top-p, top-k,
min-p, penalties some row uses: a round without them replays the plain graphs; penalty graphs read
and update ``DecodeSteps.counts`` in place, and are keyed by that object). A round of ``B <= Bb``
rows copies the host inputs into pinned staging (rows ``B..Bb`` inert: anchor / start / pages -1),
does two H2D copies, launches the draft and verify graphs, one D2H copy of ``[B, 2 + N]`` int64,
and synchronises once. Nothing is allocated on the device or in pinned memory per round.

Confidence modes (``spec_round_admitted``): the same round with two graphs of the same shapes,
"draft_admit" (the draft step with the confidence head and the on-device admission, writing the
admitted lengths) and "verify_admit" (the verify of all N drafts with those lengths, its output
carrying them back: ``[B, 3 + w]``). Under the scheduler's "padded" cost model ``w = N``: the same
H2D / launches / one D2H / one sync as a fixed round. Under "trimmed" (the default) there is one
"verify_admit" graph per width bucket ``w`` (``VerifyScheduler.widths``) and the round reads the
admitted lengths back after the draft graph (a second small D2H and sync) to launch the graph of
``w = verify_width(max l)``. ``capture`` captures every width ahead of time.

Capture uses cuda-python (``cuda.bindings.runtime``: cudaStreamBeginCapture on a non-default torch
stream, cudaStreamEndCapture, cudaGraphInstantiate, cudaGraphLaunch on torch's current stream);
torch's allocator is pointed at one private ``torch.cuda.MemPool`` during capture so the graphs'
intermediate buffers are never handed to other tensors (one pool shared by all graphs, which never
run concurrently). ``backend="torch"`` uses ``torch.cuda.CUDAGraph`` instead. Each capture is
preceded by one eager warm-up run on the capture stream (kernel compilation, cuBLAS workspaces).

The admission prefill replays graphs too, one per padded (batch, length) shape
(``prefill_graphs.py``), captured on first use in the same pool.

``backend="eager-replay"`` (tests on CPU; not a CLI choice): nothing is captured, ``launch`` reruns
the step eagerly and copies its results into the first run's output tensors. It checks the static
buffer plumbing (staging, inert rows, graph-to-graph outputs) where no GPU is available, not
capturability.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .context_rows import ContextRows
from .deferred_context import SLOT_ROWS
from .packed_verify import check_packable
from .prefill_graphs import PrefillGraphs
from .sampling_modifiers import Modifiers
from .steps import MODIFIER_FIELDS, DecodeSteps, DeviceInputs, RoundInputs, StagedRound, run_host_work, widen

log = logging.getLogger(__name__)

BACKENDS = ("cuda-python", "torch")
EAGER_REPLAY = "eager-replay"          # CPU tests: the static-buffer plumbing without capture


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, plus ``max_batch_size`` itself."""
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    out = [b for b in (1 << i for i in range(max_batch_size.bit_length())) if b <= max_batch_size]
    return out if out[-1] == max_batch_size else out + [max_batch_size]


def graphs_unavailable_reason(device) -> str | None:
    """Why CUDA graphs cannot be used on ``device`` (None when they can)."""
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device; the networks run on '{torch.device(device).type}'"
    if not torch.cuda.is_available():
        return "torch reports no CUDA device"
    return None


def default_backend() -> str:
    try:
        from cuda.bindings import runtime  # noqa: F401
        return "cuda-python"
    except ImportError:
        log.info("cuda-python is not installed: capturing with torch.cuda.CUDAGraph")
        return "torch"


# ---- one captured graph --------------------------------------------------------------------------

def cuda_check(ret, what: str):
    """The result(s) of a cuda-python runtime call, or RuntimeError naming ``what`` and the error."""
    from cuda.bindings import runtime as rt
    err, *rest = ret if isinstance(ret, tuple) else (ret,)
    if err != rt.cudaError_t.cudaSuccess:
        name = rt.cudaGetErrorName(err)[1].decode()
        raise RuntimeError(f"{what} failed: {name}")
    return rest[0] if len(rest) == 1 else rest


class CapturedGraph:
    """``fn()`` captured once on a side stream; ``launch()`` replays it on the current stream.

    ``outputs`` are the tensors ``fn`` returned during capture: the replay rewrites them in place.
    """

    def __init__(self, fn: Callable[[], object], pool, backend: str,
                 stream: torch.cuda.Stream | None = None, warmup: int = 1):
        """``pool``: a ``torch.cuda.MemPool`` (cuda-python) or a ``graph_pool_handle()`` (torch);
        ``stream``: the non-default capture stream (graphs sharing a pool should share it, since
        the allocator reuses a freed block only on the stream it was allocated on)."""
        if backend not in BACKENDS + (EAGER_REPLAY,):
            raise ValueError(f"unknown CUDA graph backend '{backend}' (choose from {BACKENDS})")
        self.backend = backend
        if backend == EAGER_REPLAY:
            self._fn = fn
            self.outputs = fn()
            return
        stream = stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        stream.synchronize()
        if backend == "torch":
            self._graph = torch.cuda.CUDAGraph()
            with _no_gc(), torch.cuda.graph(self._graph, pool=pool, stream=stream,
                                            capture_error_mode="thread_local"):
                self.outputs = fn()
            self._prime()
            return
        from cuda.bindings import runtime as rt
        handle = stream.cuda_stream
        with _no_gc(), torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
            cuda_check(rt.cudaStreamBeginCapture(
                handle, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture")
            try:
                self.outputs = fn()
            except BaseException:     # end the capture (or the stream stays unusable), clear, re-raise
                rt.cudaStreamEndCapture(handle)
                rt.cudaGetLastError()
                raise
            graph = cuda_check(rt.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
        self._graph = graph
        self._exec = cuda_check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        self._rt = rt
        self._prime()

    def _prime(self) -> None:
        """Replay once: capture records kernels without running them, so until a replay the
        outputs hold garbage, and a graph captured next that reads them (verify reads the draft
        graph's drafts) would warm up on garbage token ids."""
        self.launch()
        torch.cuda.current_stream().synchronize()

    def launch(self) -> None:
        if self.backend == EAGER_REPLAY:
            new = self._fn()
            with torch.inference_mode():
                for o, n in zip(*((t,) if isinstance(t, Tensor) else t for t in (self.outputs, new))):
                    o.copy_(n)
            return
        if self.backend == "torch":
            self._graph.replay()
        else:
            cuda_check(self._rt.cudaGraphLaunch(self._exec, torch.cuda.current_stream().cuda_stream),
                       "cudaGraphLaunch")

    def __del__(self):
        if getattr(self, "backend", None) == "cuda-python" and hasattr(self, "_exec"):
            try:
                self._rt.cudaGraphExecDestroy(self._exec)
                self._rt.cudaGraphDestroy(self._graph)
            except Exception:          # interpreter shutdown
                pass


@contextlib.contextmanager
def _no_gc():
    """No garbage collection while a stream captures: a collected ``CapturedGraph`` (or any
    object freeing CUDA resources) would destroy its graph mid-capture, which aborts the process
    (seen on the H200 in a test that captures many graphs); the cycles wait for the next
    collection after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- static buffers of one bucket ---------------------------------------------------------------

# the flat int64 / f32 input segments of a bucket and each one's inert value (the table follows
# the int64 segments)
INT_FIELDS = {"anchor": -1, "start": -1, "seed": 0, "verify_mode": 0, "tap_row": -1,
              **{f: v for f, (v, t) in MODIFIER_FIELDS.items() if t == np.int64}}
F32_FIELDS = {"temperature": 0.0, "top_p": 1.0, "threshold": 0.0,
              **{f: v for f, (v, t) in MODIFIER_FIELDS.items() if t == np.float32}}


class BucketBuffers:
    """Static inputs of bucket ``Bb``: int64 [``INT_FIELDS`` | table] and f32 [``F32_FIELDS``],
    each one flat device tensor with a pinned host twin (segments 16-byte aligned); plus pinned
    output buffers."""

    def __init__(self, Bb: int, max_pages: int, device):
        self.Bb, self.P = Bb, max_pages
        self.cuda = torch.device(device).type == "cuda"
        # every segment starts on a 16-byte boundary: AOTInductor engines assume aligned inputs
        # (and copy a misaligned one on every call)
        si, sf = -(-Bb // 2) * 2, -(-Bb // 4) * 4               # int64 / f32 segment strides
        self.si, self.sf = si, sf
        self.ti = len(INT_FIELDS) * si                          # the table's offset
        ni, nf = self.ti + Bb * max_pages, len(F32_FIELDS) * sf
        self.host_i = torch.empty(ni, dtype=torch.int64, pin_memory=self.cuda)
        self.host_f = torch.empty(nf, dtype=torch.float32, pin_memory=self.cuda)
        self.dev_i = torch.empty(ni, dtype=torch.int64, device=device)
        self.dev_f = torch.empty(nf, dtype=torch.float32, device=device)
        self._host_out: dict[int, Tensor] = {}            # width -> pinned [Bb, width] int64
        self._hi, self._hf = self.host_i.numpy(), self.host_f.numpy()
        # field -> (host segment [Bb], device segment [Bb], inert value)
        self._segs = {f: (self._hi[k * si:k * si + Bb], self.dev_i[k * si:k * si + Bb], v)
                      for k, (f, v) in enumerate(INT_FIELDS.items())}
        self._segs.update({f: (self._hf[k * sf:k * sf + Bb], self.dev_f[k * sf:k * sf + Bb], v)
                           for k, (f, v) in enumerate(F32_FIELDS.items())})
        self.inputs = DeviceInputs(table=self.dev_i[self.ti:].view(Bb, max_pages),
                                   **{f: d for f, (_, d, _) in self._segs.items()})
        self.fill(None)
        self.upload()

    def fill(self, r: RoundInputs | None) -> None:
        """Write ``r`` into the pinned staging; rows past ``r.batch_size`` are inert (and every row
        of a field that ``r`` leaves None: its neutral value)."""
        B = 0 if r is None else r.batch_size
        table = self._hi[self.ti:].reshape(self.Bb, self.P)
        table[:] = -1
        for f, (host, _, inert) in self._segs.items():
            host[:] = inert
            if B and getattr(r, f) is not None:
                host[:B] = getattr(r, f)
        if B:
            if r.table.shape[1] != self.P:
                raise ValueError(f"block table has {r.table.shape[1]} columns, the graphs were "
                                 f"built for {self.P}")
            table[:B] = r.table

    def upload(self) -> None:
        self.dev_i.copy_(self.host_i, non_blocking=True)
        self.dev_f.copy_(self.host_f, non_blocking=True)

    def download(self, out: Tensor, B: int, host_work: Callable[[], None] | None = None) -> np.ndarray:
        """Copy ``out[:B]`` to the pinned output and synchronise (the round's one host sync);
        ``host_work`` runs between the queued copy and the wait."""
        w = out.shape[1]
        if w not in self._host_out:
            self._host_out[w] = torch.empty(self.Bb, w, dtype=torch.int64, pin_memory=self.cuda)
        host = self._host_out[w][:B]
        host.copy_(out[:B], non_blocking=self.cuda)
        run_host_work(host_work)
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        return host.numpy().copy()              # the pinned buffer is rewritten next round


# ---- the graphed steps -----------------------------------------------------------------------------

class GraphedSteps:
    """``DecodeSteps`` replayed from CUDA graphs per batch bucket (same ``*_round`` interface)."""

    def __init__(self, steps: DecodeSteps, max_batch_size: int, max_pages: int,
                 backend: str | None = None):
        reason = None if backend == EAGER_REPLAY else graphs_unavailable_reason(steps.device)
        if reason:
            raise RuntimeError(f"cannot build CUDA graphs: {reason}")
        self.steps = steps
        self.device = steps.device
        self.num_spec_tokens = steps.num_spec_tokens
        self.buckets = batch_buckets(max_batch_size)
        self.max_pages = max_pages
        self.backend = backend or default_backend()
        if self.backend == EAGER_REPLAY:
            self.pool = self.capture_stream = None
        else:
            self.pool = (torch.cuda.MemPool() if self.backend == "cuda-python"
                         else torch.cuda.graph_pool_handle())
            self.capture_stream = torch.cuda.Stream()
        self._buffers: dict[int, BucketBuffers] = {}
        self._graphs: dict[tuple, CapturedGraph] = {}
        self._trimmed_verify: dict[tuple, dict] = {}   # (width, slots) -> graph, per round shape
        self._draft_z: dict[int, Tensor] = {}          # bucket -> the z store of its "draft_admit" graphs
        capture = lambda fn: CapturedGraph(fn, self.pool, self.backend, self.capture_stream)  # noqa: E731
        self.prefills = PrefillGraphs(self, capture)
        self.context_rows = ContextRows(steps.nets, capture, max_batch_size, max_pages)   # deferred context

    @property
    def verify_widths(self):
        """Confidence rounds per verify window (the eager steps' counter)."""
        return self.steps.verify_widths

    @property
    def window_rounds(self):
        """Window rounds per width (the eager steps' counter)."""
        return self.steps.window_rounds

    @property
    def verify_slots(self):
        """Packed confidence rounds per slot count (the eager steps' counter)."""
        return self.steps.verify_slots

    @property
    def eager(self) -> DecodeSteps:
        """The eager steps these graphs replay."""
        return self.steps

    def replayable(self, fn: Callable[[], object]) -> Callable[[], object]:
        """A CUDA graph of fn (captured now, in this pool and stream), as its launch callable."""
        return CapturedGraph(fn, self.pool, self.backend, self.capture_stream).launch

    def stage(self, r: RoundInputs) -> StagedRound:
        """As ``DecodeSteps.stage``, from the graphs of r's bucket (``x``: the bucket's rows)."""
        Bb = self.bucket(r.batch_size)
        buf = self.buffers(Bb)
        spec = bool(self.num_spec_tokens)
        g = {k: self.graph(k, Bb) for k in (("draft", "verify", "ar") if spec else ("ar",))}
        buf.fill(r)
        buf.upload()
        x = buf.inputs
        if not spec:
            return StagedRound(x, x.anchor[:, None][:, :0], None, None, None, g["ar"].launch)
        g["draft"].launch()                   # as DecodeSteps.stage: drafts / z of these inputs
        drafts, z = g["draft"].outputs
        return StagedRound(x, drafts, z, g["draft"].launch, g["verify"].launch, g["ar"].launch)

    def bucket(self, B: int) -> int:
        for b in self.buckets:
            if b >= B:
                return b
        raise ValueError(f"batch of {B} rows exceeds the largest graph bucket {self.buckets[-1]}")

    def buffers(self, Bb: int) -> BucketBuffers:
        if Bb not in self._buffers:
            self._buffers[Bb] = BucketBuffers(Bb, self.max_pages, self.device)
        return self._buffers[Bb]

    @property
    def confidence(self) -> bool:
        """Whether the confidence rounds can run (a draft with a head and a scheduler)."""
        return (self.steps.scheduler is not None
                and getattr(self.steps.nets, "has_confidence", False))

    def graph(self, kind: str, Bb: int, mods: Modifiers | bool = False, width: int | None = None,
              slots: int | None = None, head: int | None = None) -> CapturedGraph:
        """The graph ``kind`` in {"draft", "verify", "draft_admit", "verify_admit", "ar", "ar_taps"
        (the AR step storing its taps in the steps' ``tap_store`` at the inputs' ``tap_row``, for
        the fallback's deferred context)} of bucket
        ``Bb`` and modifiers ``mods`` (captured on first use); "verify_admit" verifies the first
        ``width`` (None: all N) drafts of the "draft_admit" graph with its admitted lengths,
        packed into ``slots`` token slots when given (``packed_verify.py``); "draft" / "verify"
        with ``width`` < N: the window round's steps (``DecodeSteps.spec_round(width=)``);
        "draft_admit" / "verify_admit" of ``head`` (None: N) drafted (``DecodeSteps.draft_admit_step``)."""
        mods = Modifiers() if kind in ("draft", "draft_admit") else Modifiers.of(mods)
        head = head or self.num_spec_tokens
        if kind == "verify_admit" and width is None:
            width = head
        window = kind in ("draft", "verify") and width is not None and width < self.num_spec_tokens
        # penalty graphs bake in the token counts' tensors: keyed by that state too
        sched = self.steps.scheduler                  # its cost model is baked into the admission
        key = ((kind, Bb, mods) + ((width, slots) if kind == "verify_admit" else ())
               + ((width,) if window else ())
               + ((sched.cost_model, head) if kind in ("draft_admit", "verify_admit") else ())
               + ((self.steps.counts,) if mods.penalties else ())
               + ((self.steps.tap_rows,) if kind == "ar_taps" else ()))
        if key in self._graphs:
            return self._graphs[key]
        x = self.buffers(Bb).inputs
        if kind == "draft":
            fn = lambda: self.steps.draft_step(x, width)  # noqa: E731
        elif kind == "draft_admit":
            h, z = head if head < self.num_spec_tokens else None, self.draft_z(Bb, head)
            fn = lambda: self.steps.draft_admit_step(x, h, z)  # noqa: E731
        elif kind == "verify":
            drafts, z = self.graph("draft", Bb, width=width).outputs
            fn = lambda: self.steps.verify_step(x, drafts, z, mods)  # noqa: E731
        elif kind == "verify_admit":
            drafts, z, _, limit = self.graph("draft_admit", Bb, head=head).outputs
            fn = lambda: self.steps.verify_admit_step(x, drafts, z, limit, mods, width, slots)  # noqa: E731
        elif kind in ("ar", "ar_taps"):
            fn = lambda: self.steps.ar_step(x, mods, keep_taps=kind == "ar_taps")  # noqa: E731
        else:
            raise ValueError(f"unknown graph kind '{kind}'")
        log.debug("capturing %s graph for batch bucket %d (%s)", kind, Bb, mods)
        self.buffers(Bb).fill(None)           # capture on inert rows: the warm-up writes nothing
        self.buffers(Bb).upload()
        self._graphs[key] = CapturedGraph(fn, self.pool, self.backend, self.capture_stream)
        return self._graphs[key]

    def draft_z(self, Bb: int, head: int) -> Tensor:
        """The z output [Bb, head, V] fp32 of bucket ``Bb``'s "draft_admit" graph of ``head``: one
        store per bucket, [Bb, N, V], shared by the graphs of every head width and cost model (a
        round replays one of them, then the verify that reads it; each graph kept its own: ~0.27
        GB a head at 64 rows and Qwen3's vocabulary). Allocated outside any graph's pool."""
        if Bb not in self._draft_z:
            n, vocab = self.num_spec_tokens, self.steps.nets.vocab_size
            self._draft_z[Bb] = torch.empty(Bb * n * vocab, dtype=torch.float32, device=self.device)
        vocab = self.steps.nets.vocab_size
        return self._draft_z[Bb][: Bb * head * vocab].view(Bb, head, vocab)

    def capture(self, speculative: bool = True, buckets: list[int] | None = None,
                prefill_lengths: list[int] | None = None) -> None:
        """Capture ahead of time, largest bucket first (the others reuse its pool memory); with a
        confidence head, the confidence rounds' two graphs too; with ``prefill_lengths``, the
        prefill graphs of those prompt lengths for every bucket that has one, and where the
        scheduler may fall back to AR rounds the ones that keep the prompts' taps (an admission
        inside an AR streak: ``Scheduler._defers_prompts``); captured on first use they were
        inside the timed rounds (H100, default pair, steady load at batch 4: 5.8 ms per admission
        prefill against 3.2 without the fallback)."""
        kinds = ("ar",)
        if speculative:
            kinds = ("draft", "verify") + (("draft_admit", "verify_admit") if self.confidence else ())
        sched = self.steps.scheduler
        falls_back = speculative and self.confidence and sched is not None and sched.falls_back
        if falls_back:
            kinds += ("ar_taps",)
            self.steps.reserve_taps(self.buckets[-1] * SLOT_ROWS)     # every scheduler's DeferredContext
        for Bb in sorted(buckets or self.buckets, reverse=True):
            for kind in kinds:
                if kind in ("draft_admit", "verify_admit"):
                    self._capture_admission(kind, Bb)
                else:
                    self.graph(kind, Bb)
            for w in (self._window_widths(Bb) if speculative else []):
                self.graph("verify", Bb, width=w)                  # captures its "draft" too
        if falls_back and self.steps.tap_store is not None:   # the late draft-context writes (the
            # "ar_taps" warm-up made the store)
            self.context_rows.capture_all(self.steps.tap_store)
        if prefill_lengths:
            sizes = sorted(buckets or self.buckets, reverse=True)
            self.prefills.capture(sizes, prefill_lengths, context=speculative)
            if falls_back:
                self.prefills.capture(sizes, prefill_lengths, context=False, keep_taps=True)

    def _capture_admission(self, kind: str, Bb: int) -> None:
        """The confidence rounds' graphs of ``kind`` ("draft_admit" / "verify_admit") of bucket
        ``Bb``: one set per cost model its rounds may run ("auto": two) and, packed, per head width
        (``bucket_heads``); the scheduler's current model is kept."""
        sched = self.steps.scheduler
        active = sched.cost_model
        for model in sched.bucket_models(Bb):
            sched.activate(model)
            for h in (sched.bucket_heads(Bb) if model == "packed" else [None]):
                for w, n in (self._verify_sizes(Bb, h) if kind == "verify_admit" else [(None, None)]):
                    self.graph(kind, Bb, width=w, slots=n, head=h)
        sched.activate(active)

    # ---- rounds -----------------------------------------------------------------------------------
    def prefill(self, tokens: Tensor, positions: Tensor, table: Tensor, lens: Tensor, context: bool,
                keep_taps: bool = False):
        """As ``DecodeSteps.prefill``, from a graph of the padded shape (``prefill_graphs.py``)."""
        return self.prefills.run(tokens, positions, table, lens, context, keep_taps)

    def spec_round(self, r: RoundInputs, mods: Modifiers | bool, width: int | None = None,
                   host_work: Callable[[], None] | None = None) -> np.ndarray:
        """As ``DecodeSteps.spec_round``: the "draft" and "verify" graphs (of the window ``width``)."""
        if width is not None and width >= self.num_spec_tokens:
            width = None
        if width is not None:
            self.steps.window_rounds[width] += 1
        return widen(self._replay_round("draft", "verify", r, mods, width, host_work)[0], self.num_spec_tokens)

    def _window_widths(self, Bb: int) -> list[int]:
        """The widths < N of bucket ``Bb``'s window rounds, where its scheduler estimates windows
        (``VerifyScheduler.estimates_windows``; a confidence head, a cost curve with step
        latencies); none otherwise."""
        sched = self.steps.scheduler
        smaller = [b for b in self.buckets if b < Bb]
        rows = range(max(smaller, default=0) + 1, Bb + 1)       # the row counts this bucket runs
        if not (self.confidence and sched.falls_back and any(sched.estimates_windows(r) for r in rows)):
            return []
        return [w for w in sched.widths if w < self.num_spec_tokens]

    def _verify_sizes(self, Bb: int, head: int | None = None) -> list[tuple[int | None, int | None]]:
        """The (width, slots) of the "verify_admit" graphs of bucket ``Bb`` after a draft of
        ``head`` (None: N): one per width bucket up to it (trimmed and packed: a packed round whose
        window runs no more tokens verifies that window), plus one per slot bucket at width
        ``head`` (packed); else the full window."""
        sched, h = self.steps.scheduler, head or self.num_spec_tokens
        sizes = [(w, None) for w in (sched.widths if sched is not None and sched.trims else [None])
                 if w is None or w <= h]
        if sched is not None and sched.packs:
            check_packable(self.steps.nets)
            sizes += [(h, n) for n in sched.slot_sizes(Bb, h)]
        return sizes

    def _trimmed_verify_graphs(self, kind: str, Bb: int, mods: Modifiers | bool, head: int | None = None) -> dict:
        """Every verify graph a trimming (or packing) round of bucket ``Bb`` may launch, by (width,
        slots) (``_verify_sizes``), captured on first use, then kept per round shape: the lookup
        of each (27 at batch 64 under the packed model, 68 us on 2 cores) was on the round's path
        before the draft's launch. Keyed by what ``graph`` keys them by (graphs are never dropped)."""
        sched = self.steps.scheduler
        mods = Modifiers.of(mods)
        key = (kind, Bb, mods, sched, sched.cost_model, head) + ((self.steps.counts,) if mods.penalties else ())
        graphs = self._trimmed_verify.get(key)
        if graphs is None:
            graphs = self._trimmed_verify[key] = {s: self.graph(kind, Bb, mods, *s, head=head)
                                                  for s in self._verify_sizes(Bb, head)}
        return graphs

    def _replay_round(self, draft_kind: str, verify_kind: str, r: RoundInputs, mods: Modifiers | bool,
                      width: int | None = None, host_work: Callable[[], None] | None = None,
                      head: int | None = None):
        """Upload ``r``, replay the draft then the verify graph of its bucket -> (verify outputs
        [B, ...] on the host, the draft graph). A "verify_admit" round of a trimming scheduler
        reads the admitted lengths back between the two to pick the window's graph (a packing
        one: the slots' graph), unless the caller chose the window (``width``). ``host_work``:
        run before the final read-back waits. ``head``: a confidence round drafting that many."""
        B = r.batch_size
        Bb = self.bucket(B)
        sched = self.steps.scheduler
        trims = (width is None and verify_kind == "verify_admit" and sched is not None
                 and sched.trims)
        # every graph the round may launch exists before the inputs are staged (a capture stages
        # inert rows)
        head = head if draft_kind == "draft_admit" and width is None else None
        draft = self.graph(draft_kind, Bb, width=width if draft_kind == "draft" else None, head=head)
        verify = (self._trimmed_verify_graphs(verify_kind, Bb, mods, head) if trims
                  else {(width, None): self.graph(verify_kind, Bb, mods, width, head=head)})
        buf = self.buffers(Bb)
        buf.fill(r)
        buf.upload()
        draft.launch()
        slots = None
        if trims:                                        # [B] admitted lengths -> the window
            lim = buf.download(draft.outputs[3].view(-1, 1), B)[:, 0]
            width, slots = sched.verify_shape(lim[np.asarray(r.start) >= 0], Bb, head)
        if verify_kind == "verify_admit":
            self.steps.verify_widths[width or head or self.num_spec_tokens] += 1
        if slots is not None:
            self.steps.verify_slots[slots] += 1
        g = verify[(width, slots)]
        g.launch()
        return buf.download(g.outputs, B, host_work), draft

    def spec_round_admitted(self, r: RoundInputs, mods: Modifiers | bool, want_confidence: bool = False,
                            width: int | None = None, host_work: Callable[[], None] | None = None,
                            head: int | None = None):
        """As ``DecodeSteps.spec_round_admitted``: fixed rounds replay the plain graphs, confidence
        rounds "draft_admit" + "verify_admit" (the window of ``_replay_round``, or ``width``) of
        ``head`` drafted."""
        B, N = r.batch_size, self.num_spec_tokens
        if width is None and not (self.steps.needs_admission(r) or want_confidence):
            return self.spec_round(r, mods, host_work=host_work), np.where(r.start >= 0, N, 0), None
        out, draft = self._replay_round("draft_admit", "verify_admit", r, mods, width, host_work, head)  # [B, 3+w]
        conf = draft.outputs[2][:B].float().cpu().numpy() if want_confidence else None
        return widen(out[:, :-1], N), out[:, -1], conf

    def ar_round(self, r: RoundInputs, mods: Modifiers | bool, context: bool = False) -> np.ndarray:
        if context:                       # no graph of it: the fallback defers its context write
            return self.steps.ar_round(r, mods, context=True)
        return self._replay_ar("ar", r, mods)

    def ar_round_keep_taps(self, r: RoundInputs, mods: Modifiers | bool) -> np.ndarray:
        """As ``DecodeSteps.ar_round_keep_taps``: the store of the taps is inside the graph (no
        launch and no index upload of its own: ``tap_row`` travels with the round's inputs)."""
        return self._replay_ar("ar_taps", r, mods)

    def _replay_ar(self, kind: str, r: RoundInputs, mods: Modifiers | bool) -> np.ndarray:
        B = r.batch_size
        Bb = self.bucket(B)
        ar = self.graph(kind, Bb, mods)
        buf = self.buffers(Bb)
        buf.fill(r)
        buf.upload()
        ar.launch()
        return buf.download(ar.outputs, B)
