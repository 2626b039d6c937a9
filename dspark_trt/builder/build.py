"""``build_engine``: models -> three exported networks -> compiled engine directory.

Stages (each reported with its elapsed time): load, convert, export <network>, compile
<network>, write. Weights are stored once in ``weights.safetensors`` (tensors shared by several
networks, e.g. the embedding and lm_head the draft borrows from the target, are deduplicated by
storage) for the AOTI backend; TensorRT plans carry their own weights.

``tp_size`` > 1 (AOTI): one process per rank (torchrun, or ``dspark-trt build`` starts them);
each rank shards the models (``parallel.shard_pair_``), exports its networks with their
collectives (``_c10d_functional`` ops, compiled by AOTInductor) and writes ``rank<r>/`` (its
packages, weight shard, cache layout); rank 0 writes the one manifest, with ``tp_size`` and a
``ranks`` list, and renames the directory into place once every rank has succeeded.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import resource
import shlex
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError, ModelPair, get_preset
from ..config.dtypes import ENGINE_DTYPES, torch_dtype
from ..config.source import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, MARKOV_SAMPLERS, ModelSource,
                             resolve_num_spec_tokens)
from ..checkpoints.files import CALIBRATION_FILE, calibration_file, sidecar_mismatch
from ..checkpoints.prepare import prepare_models
from ..devices import resolve_device
from ..progress import bar
from ..engine import manifest as ed
from ..engine.caches import cache_layout
from .backends import BuildError, pick_backend
from .output_dir import atomic_engine_dir, choose_output, clean_stale_temp_dirs
from .export import (NETWORKS, BuildShapes, export_network, network_specs, ops_to_inline,
                     reference_impls, reference_reason)

log = logging.getLogger(__name__)
WEIGHTS = "weights.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")


@dataclass
class BuildOptions(ModelSource):
    """``ModelSource`` (what to build from; no ``engine``) with the build's defaults and options."""

    model: str = ""                           # preset name (or the engine's name with checkpoints)
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    markov_sampler: str = "exact"             # compiled into draft_block (models.dspark_qwen3.markov_sampler_op)
    output: str | None = None                 # default engines/<model>
    backend: str = "auto"
    page_size: int = 64
    overrides: list[str] = field(default_factory=list)
    seed: int = 0                             # of the random weights
    check_toolchain: bool = True              # build + load a probe package first (AOTI)
    allow_reference_ops: bool = False         # a failed Triton-kernel build falls back to references
    force: bool = False                       # output holds other files: build into output/<model>

    def resolved(self) -> "BuildOptions":
        """Defaults filled in and every option checked, before anything loads: ``ConfigError``
        names the option; ``output_dir.OutputError`` refuses an output directory that holds
        files that are not an engine (``force``: ``output/<model>`` instead, said in
        ``output_note``)."""
        o = dataclasses.replace(self)
        o.device = str(resolve_device(o.device))
        o.dtype = o.dtype or ("bf16" if o.device.startswith("cuda") else "fp32")
        torch_dtype(o.dtype, ENGINE_DTYPES)
        if not o.model:
            raise ConfigError("--model is required (a preset name, or the engine's name with checkpoints)")
        if o.engine:
            raise ConfigError("a build reads a preset or checkpoints, not an engine")
        for name in ("max_batch_size", "max_seq_len", "page_size"):
            if getattr(o, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(o, name)}")
        if o.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {o.tp_size}")
        if o.tp_size > 1 and o.backend == "tensorrt":
            raise ConfigError(f"--tp-size {o.tp_size}: per-rank engines are built with the aoti "
                              "backend (the TensorRT export has no collectives)")
        if o.expert_parallel and o.tp_size == 1:
            raise ConfigError("--expert-parallel needs --tp-size > 1")
        if o.markov_sampler not in MARKOV_SAMPLERS:
            raise ConfigError(f"--markov-sampler {o.markov_sampler!r}: choose one of {', '.join(MARKOV_SAMPLERS)}")
        if bool(o.checkpoint) != bool(o.draft_checkpoint):
            raise ConfigError("--checkpoint and --draft-checkpoint go together")
        if not o.checkpoint and not o.random_weights:
            raise ConfigError("no weights: pass --checkpoint and --draft-checkpoint, or --random-weights")
        if o.checkpoint and o.overrides:
            raise ConfigError("--override edits a preset's config; it cannot be combined with --checkpoint")
        from ..checkpoints.fp8 import check_draft_quantization
        check_draft_quantization(o.draft_quantization, None, o.tp_size)
        if o.draft_vocab:                                         # a bad file: before anything loads
            from ..checkpoints.prepare import check_draft_vocab
            check_draft_vocab(o.draft_vocab, o.tp_size)
        if not o.checkpoint:                                      # unknown preset, too long: say so now
            pair = get_preset(o.model)
            if not o.overrides:                                   # (else checked once loaded)
                pair.check_limits(o.max_batch_size, o.max_seq_len)
        path, o.output_note = choose_output(o.output or Path("engines") / o.model, o.model, o.force)
        o.output = str(path)
        return o

    def command_line(self) -> str:
        args = ["dspark-trt", "build", "--model", self.model]
        for name in ("checkpoint", "draft_checkpoint", "dtype", "backend", "max_batch_size", "max_seq_len",
                     "num_spec_tokens", "page_size", "output", "device", "markov_sampler", "draft_vocab",
                     "quantization", "draft_quantization"):
            v = getattr(self, name)
            if v is not None:
                args += [f"--{name.replace('_', '-')}", str(v)]
        if self.tp_size > 1:
            args += ["--tp-size", str(self.tp_size)] + (["--expert-parallel"] if self.expert_parallel else [])
        if self.random_weights:
            args.append("--random-weights")
        if self.allow_reference_ops:
            args.append("--allow-reference-ops")
        for ov in self.overrides:
            args += ["--override", ov]
        return shlex.join(args)


# ---- progress ------------------------------------------------------------------------------------

class Progress:
    """Build stages: a report line at each start and end (with times) and a progress bar."""

    def __init__(self, report: Callable[[str], None]):
        self.report, self.t0, self.stages = report, time.perf_counter(), {}
        self.bar = bar(desc="build", unit="stage")

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        self.report(f"[build] {name} ...")
        self.bar.set_description(f"build: {name}")
        yield
        self.bar.update()
        self.stages[name] = round(time.perf_counter() - t, 2)
        self.report(f"[build] {name} done in {self.stages[name]:.1f} s "
                    f"(total {time.perf_counter() - self.t0:.1f} s)")


def peak_memory() -> dict:
    """Peak resident host memory of this process and its (compiler) children, GiB; GPU peak."""
    kib = 1 / (1 << 20)
    out = {"host_self_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib, 3),
           "host_children_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib, 3)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 3)
    return out


# ---- models ------------------------------------------------------------------------------------

def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ConfigError(f"--override {text!r}: expected key=value (e.g. num_hidden_layers=4)")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def apply_overrides(pair: ModelPair, overrides: list[str]) -> ModelPair:
    """``key=value`` edits the target config, ``draft.key=value`` the draft config.

    When the target's layer count changes, the draft's ``num_target_layers`` follows and its tap
    layers are respaced over the new depth if they no longer fit (logged); the draft keeps its
    own dimensions.
    """
    target, draft = pair.target, pair.draft
    for text in overrides:
        key, value = parse_override(text)
        obj_name, key = ("draft", key[6:]) if key.startswith("draft.") else ("target", key)
        obj = draft if obj_name == "draft" else target
        if key not in {f.name for f in dataclasses.fields(obj)}:
            raise ConfigError(f"--override {text!r}: {type(obj).__name__} has no field '{key}'")
        obj = dataclasses.replace(obj, **{key: value})
        if obj_name == "draft":
            draft = obj
        else:
            target, old = obj, target
            if key == "num_hidden_layers":
                target, draft = _follow_target_depth(old, target, draft)
    return dataclasses.replace(pair, target=target, draft=draft).validate()


def _follow_target_depth(old, target, draft):
    """After the target's depth changed: V4 keeps the first layers' compress ratios (and the draft
    stages' trailing entries) and the draft's backbone copy follows; the taps are refitted."""
    K = target.num_hidden_layers
    if hasattr(target, "compress_ratios"):
        r = list(old.compress_ratios)
        target = dataclasses.replace(target, compress_ratios=r[:K] + r[old.num_hidden_layers:],
                                     num_hash_layers=min(target.num_hash_layers, K))
        draft = dataclasses.replace(draft, backbone=dataclasses.replace(target))
    return target, _refit_taps(draft, K, last_layer_taps=hasattr(target, "compress_ratios"))


def _refit_taps(draft, num_layers: int, last_layer_taps: bool = False):
    """Respace taps that no longer fit. Qwen3 taps must lie below the last layer (HF final-norms
    its hidden state); V4 taps (stream means of a layer's output) may include it."""
    ids = list(getattr(draft, "target_layer_ids", []))
    limit = num_layers if last_layer_taps else num_layers - 1            # taps < limit
    if ids and ids[-1] >= limit:
        m = len(ids)
        if m > limit:
            raise ConfigError(f"--override num_hidden_layers={num_layers}: the draft taps {m} target "
                              f"layers, which needs at least {m + num_layers - limit} layers "
                              "(or set draft.target_layer_ids)")
        new = [round(i * (num_layers - 2) / max(m - 1, 1)) for i in range(m)] if m > 1 else [0]
        log.warning("draft target_layer_ids %s do not fit %d target layers: using %s", ids, num_layers, new)
        draft = dataclasses.replace(draft, target_layer_ids=new)
    if "num_target_layers" in {f.name for f in dataclasses.fields(draft)}:
        draft = dataclasses.replace(draft, num_target_layers=num_layers)
    return draft


def load_models(o: BuildOptions, dtype: torch.dtype, device: torch.device, tp=None):
    """-> (pair, target, draft) as exported: ``checkpoints.prepare_models`` with projections fused
    (a preset gets ``o.overrides`` first); random weights are initialised directly on ``device``."""
    preset = None if o.checkpoint else apply_overrides(get_preset(o.model), o.overrides)
    pair, target, draft = prepare_models(o, dtype, device, tp, pair=preset, seed=o.seed, fuse=True)
    pair.name = o.model
    return pair, target, draft


def shared_weights(programs: dict[str, torch.export.ExportedProgram]):
    """-> (weights {stored name: tensor}, {network: {constant fqn: stored name}}); one stored
    tensor per distinct storage view, named after its first owner."""
    weights, by_key, maps = {}, {}, {}
    for net, ep in programs.items():
        maps[net] = {}
        for fqn, t in {**ep.state_dict, **ep.constants}.items():
            if not isinstance(t, torch.Tensor):
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key not in by_key:
                by_key[key] = fqn
                weights[fqn] = t
            maps[net][fqn] = by_key[key]
    return weights, maps


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path),
              metadata={"format": "pt"})


# ---- the build -----------------------------------------------------------------------------------

def build_engine(options: BuildOptions, report: Callable[[str], None] = print) -> dict:
    """Build the engine directory; returns its manifest. Nothing is left at the output path if
    any stage fails (on any rank)."""
    o = options.resolved()
    tp = _join_build_group(o)
    if tp and tp.rank != 0:
        report = lambda msg: None  # noqa: E731  (rank 0 reports)
    else:
        if o.output_note:
            report(f"[build] {o.output_note}")
        for d in clean_stale_temp_dirs(o.output):
            report(f"[build] removed {d}, left by a build that is no longer running")
    device, dtype = (tp.device if tp else torch.device(o.device)), torch_dtype(o.dtype)
    backend, why = pick_backend(o.backend)
    report(f"[build] backend: {backend} ({why}); device {device}, dtype {o.dtype}"
           + (f"; tensor parallel {tp.world} ranks" if tp else ""))
    prog = Progress(report)
    with prog.stage("load"):
        pair, target, draft = load_models(o, dtype, device, tp)
    pair.check_limits(o.max_batch_size, o.max_seq_len)    # an engine that could never load
    n = resolve_num_spec_tokens(o.num_spec_tokens, pair.draft)    # N, compiled into draft_block
    shapes = BuildShapes(o.max_batch_size, o.max_seq_len, n, o.page_size)
    with prog.stage("convert"):
        specs = network_specs(target, draft, shapes, dtype, device, o.markov_sampler)
        layouts = {"target": cache_layout(target, o.page_size, dtype),
                   "draft": cache_layout(draft, o.page_size, dtype)}
    manifest = {
        "model": o.model, "backend": backend, "dtype": o.dtype,
        "pair": {"name": pair.name, "target": ed.config_to_json(pair.target),
                 "draft": ed.config_to_json(pair.draft)},
        "shapes": {**dataclasses.asdict(shapes), "max_pages_per_seq": shapes.max_pages_per_seq},
        "build_options": dataclasses.asdict(o), "build_command": o.command_line(),
        "versions": ed.toolchain_versions(), "device": ed.device_info(device),
        "tp_size": o.tp_size, "draft_vocab": _draft_vocab_entry(draft),
    }
    part = {"caches": layouts, "networks": {}}          # what differs per rank
    written = False
    try:
        with atomic_engine_dir(o.output) if not tp or tp.rank == 0 else _no_dir() as tmp:
            tmp = _shared_path(tmp, tp)
            sub = f"rank{tp.rank}/" if tp else ""
            try:
                _check_visible(tmp, tp)
                (tmp / sub).mkdir(exist_ok=True)
                if backend == "aoti":
                    _build_aoti(o, specs, device, tmp, part, prog, report, sub)
                else:
                    _build_tensorrt(o, specs, shapes, tmp, part, prog)
                error = None
            except Exception as e:
                if not tp:
                    raise
                error = e
            parts = _gather_parts(part, error, tp)          # raises on every rank if one failed
            if tp and tp.rank != 0:
                manifest.update(part)
            else:
                with prog.stage("write"):
                    manifest.update({"ranks": parts} if tp else part)
                    manifest["tokenizer"] = _copy_tokenizer(o.checkpoint, tmp)
                    manifest["calibration"] = _copy_calibration(o.draft_checkpoint, draft, tmp, report)
                    manifest["build_stats"] = {"stage_seconds": prog.stages,
                                               "seconds": round(time.perf_counter() - prog.t0, 2),
                                               "peak_memory": peak_memory()}
                    manifest = ed.write_manifest(tmp, manifest)
        written = True
    finally:                                  # no rank returns before the directory is in place
        if tp and not _ranks_agree(written, tp) and written:
            raise BuildError(f"{o.output}: rank 0 did not write the engine directory")
    if tp and tp.rank != 0:
        return manifest
    mem = manifest["build_stats"]["peak_memory"]
    report(f"[build] wrote {o.output} in {manifest['build_stats']['seconds']:.1f} s; peak host memory "
           f"{mem['host_self_gib']:.2f} GiB (compiler processes {mem['host_children_gib']:.2f} GiB)"
           + (f", GPU {mem['gpu_gib']:.2f} GiB" if "gpu_gib" in mem else ""))
    return manifest


# ---- tensor-parallel builds: one process per rank ----------------------------------------------

def _join_build_group(o: BuildOptions):
    """None for tp_size 1; else this process's ``TPInfo`` (WORLD_SIZE must equal tp_size)."""
    if o.tp_size == 1:
        return None
    from ..parallel import init_tp
    from ..parallel.topology import Launch, check_tp_size
    launch = Launch.from_env()
    try:
        check_tp_size(o.tp_size, launch, f"--tp-size {o.tp_size}")
    except ConfigError as e:
        raise ConfigError(f"{e} (on one node, `dspark-trt build --tp-size {o.tp_size}` outside "
                          "torchrun starts the ranks itself)") from None
    return init_tp(device_type=torch.device(o.device).type)


@contextmanager
def _no_dir():
    yield None


def _shared_path(tmp: Path | None, tp) -> Path:
    """Rank 0's temporary engine directory, on every rank."""
    if not tp:
        return tmp
    import torch.distributed as dist
    box = [str(tmp) if tmp is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _check_visible(tmp: Path, tp) -> None:
    """Every rank writes its part into rank 0's temporary directory: on several nodes the output
    must be on a filesystem that all of them mount at the same path."""
    if tp and tp.rank != 0 and not tmp.is_dir():
        where = tp.launch.describe() if tp.launch else f"rank {tp.rank}"
        raise BuildError(f"{where} does not see rank 0's temporary engine directory {tmp}: a "
                         "tensor-parallel build on several nodes needs --output on a filesystem "
                         "shared by every node at the same path (or build on one node and copy it)")


def _ranks_agree(ok: bool, tp) -> bool:
    import torch.distributed as dist
    flags = [None] * tp.world
    dist.all_gather_object(flags, ok)
    return all(flags)


def _gather_parts(part: dict, error: Exception | None, tp) -> list[dict] | None:
    """Every rank's per-rank manifest part; raises on every rank if any rank failed."""
    if not tp:
        return None
    import torch.distributed as dist
    parts = [None] * tp.world
    dist.all_gather_object(parts, {"part": part, "error": None if error is None else
                                   f"{type(error).__name__}: {error}"})
    failed = [(r, p["error"]) for r, p in enumerate(parts) if p["error"]]
    if failed:
        msg = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise BuildError(f"tensor-parallel build failed on {len(failed)} rank(s): {msg}") from error
    return [p["part"] for p in parts]


def _build_aoti(o, specs, device, tmp: Path, manifest: dict, prog: Progress, report,
                sub: str = "") -> None:
    """Export + compile ``specs`` into ``tmp/sub`` (``sub``: "" or "rank<r>/"); fills ``manifest``
    with paths relative to ``tmp`` and, per network, which dspark ops are compiled Triton kernels
    and which PyTorch references (with the reason)."""
    from .backends import aoti
    cxx = aoti.select_compiler()
    manifest["compiler"] = cxx
    if o.check_toolchain:
        with prog.stage(f"check compiler {cxx}"):
            if aoti.check_toolchain(cxx, device):
                report(f"[build] compiler {cxx} passed this check before (cached)")
    inline = ops_to_inline(device)
    every_op = set(reference_impls())
    try:
        _export_and_compile(specs, device, tmp, manifest, prog, sub, cxx, inline)
    except Exception as e:
        if inline >= every_op:
            raise
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if not o.allow_reference_ops:     # the real error and its traceback, with what to try
            e.add_note("dspark-trt build: the networks were built with the Triton plugin kernels "
                       "compiled in; nothing was written. If a kernel is the cause, rebuild with "
                       "--allow-reference-ops to compile every dspark op from its PyTorch reference.")
            raise
        report(f"[build] WARNING: building with the Triton plugin kernels failed ({why}); "
               "--allow-reference-ops: compiling every dspark op from its PyTorch reference")
        manifest["networks"].clear()
        _export_and_compile(specs, device, tmp, manifest, prog, sub, cxx, every_op,
                            reason=f"--allow-reference-ops after a kernel build failure ({why})")
    ops = {}
    for net in manifest["networks"].values():
        ops.update(net["ops"])
    kernels = sorted(op for op, how in ops.items() if how == "triton kernel")
    refs = [f"{op} ({how.removeprefix('pytorch reference: ')})" for op, how in sorted(ops.items())
            if how != "triton kernel"]
    report(f"[build] dspark ops as Triton kernels: {', '.join(kernels) or 'none'}")
    report(f"[build] dspark ops as PyTorch references: {'; '.join(refs) or 'none'}")


def _export_and_compile(specs, device, tmp: Path, manifest: dict, prog: Progress, sub: str, cxx: str,
                        inline: set[str], reason: str | None = None) -> None:
    """Export and compile every network with the ops in ``inline`` as references (``reason``:
    why, for all of them; else each op's own); weights once; packages checked to load."""
    from .backends import aoti
    programs, used = {}, {}
    for spec in specs:
        with prog.stage(f"export {spec.name}"):
            programs[spec.name], used[spec.name] = export_network(spec, inline)
    weights, maps = shared_weights(programs)
    for spec in specs:
        with prog.stage(f"compile {spec.name}"):
            aoti.compile_network(programs[spec.name], tmp / f"{sub}{spec.name}.pt2", cxx)
        manifest["networks"][spec.name] = {
            "file": f"{sub}{spec.name}.pt2", "inputs": spec.input_names + ["caches"],
            "outputs": spec.output_names, "cache_group": spec.cache_group, "constants": maps[spec.name],
            "ops": {op: "triton kernel" if how == "kernel" else
                    f"pytorch reference: {reason or reference_reason(op, device)}"
                    for op, how in used[spec.name].items()}}
    with prog.stage("save weights"):
        save_weights(weights, tmp / f"{sub}{WEIGHTS}")
        manifest["weights"] = f"{sub}{WEIGHTS}"
    with prog.stage("check packages load"):
        for spec in specs:       # every constant of every package is provided by the weights file
            consts = {fqn: weights[stored] for fqn, stored in maps[spec.name].items()}
            aoti.load_network(tmp / f"{sub}{spec.name}.pt2", device, consts)


def _build_tensorrt(o, specs, shapes: BuildShapes, tmp: Path, manifest: dict, prog: Progress) -> None:
    if o.markov_sampler != "exact":
        raise BuildError(f"--markov-sampler {o.markov_sampler} has no TensorRT plugin (two kernels); "
                         "build with --markov-sampler exact or --backend aoti")
    from .backends import tensorrt as trt_backend
    from .onnx_network import export_onnx
    for spec in specs:
        with prog.stage(f"export {spec.name} (ONNX)"):
            onnx_path = tmp / f"{spec.name}.onnx"
            _, outputs = export_onnx(spec, onnx_path)
        with prog.stage(f"compile {spec.name} (TensorRT)"):
            profile = trt_backend.profile_shapes(spec, shapes)
            trt_backend.build_plan(onnx_path, profile, tmp / f"{spec.name}.plan")
        onnx_path.unlink()
        manifest["networks"][spec.name] = {
            "file": f"{spec.name}.plan", "inputs": spec.input_names, "outputs": outputs,
            "num_caches": len(spec.args[-1]), "cache_group": spec.cache_group,
            "profile": {k: [list(s) for s in v] for k, v in profile.items()}}


def _copy_tokenizer(ckpt: str | None, dst: Path) -> list[str]:
    if not ckpt:
        return []
    found = [n for n in TOKENIZER_FILES if (Path(ckpt) / n).is_file()]
    for n in found:
        shutil.copy2(Path(ckpt) / n, dst / n)
    return found


def _draft_vocab_entry(draft) -> dict | None:
    """A draft vocabulary compiled into the engine: its size (the bench's roofline) and key."""
    vocab = getattr(draft, "draft_vocab", None)
    return None if vocab is None else {"size": int(vocab.token_ids.numel()), "key": vocab.key}


def _copy_calibration(draft_ckpt: str | None, draft, dst: Path, report: Callable[[str], None] = print) -> str | None:
    """The draft's STS calibration (``dspark-trt calibrate`` writes it beside the draft) goes into
    the engine, where ``LLM.from_engine`` finds it; only with the head it calibrates."""
    src = Path(draft_ckpt) / calibration_file(draft) if draft_ckpt else None      # (a draft vocabulary's own)
    if src is None or getattr(draft, "confidence_head", None) is None:
        return None
    if not src.is_file():
        if why := sidecar_mismatch(draft_ckpt, CALIBRATION_FILE, draft):
            report(f"[build] {why}")
        return None
    shutil.copy2(src, dst / CALIBRATION_FILE)
    return CALIBRATION_FILE


__all__ = ["BuildOptions", "build_engine", "BuildError", "NETWORKS"]
