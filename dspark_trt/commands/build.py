"""``dspark-trt build``: export target and draft networks into a compiled engine directory."""
from __future__ import annotations

from ..config.dtypes import ENGINE_DTYPES
from ..config.source import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, add_source_args


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build an engine directory (aoti .pt2 or TensorRT plans)")
    add_source_args(p, ("model", "checkpoint", "draft_checkpoint", "random_weights", "dtype"),
                    model=dict(required=True, help="preset name (or the engine's name with checkpoints)"),
                    dtype=dict(choices=sorted(ENGINE_DTYPES), help="default: bf16 on cuda, fp32 on cpu"))
    p.add_argument("--backend", choices=["auto", "aoti", "tensorrt"], default="auto")
    add_source_args(p, ("max_batch_size", "max_seq_len", "num_spec_tokens"),
                    max_batch_size=dict(default=DEFAULT_MAX_BATCH_SIZE, help=None),
                    max_seq_len=dict(default=DEFAULT_MAX_SEQ_LEN, help=None),
                    num_spec_tokens=dict(help="N (default: the draft's block size)"))
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size in tokens")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="edit the target config (draft.KEY=VALUE edits the draft), repeatable")
    p.add_argument("--output", help="engine directory (default engines/MODEL); an existing directory "
                                    "is replaced only if it is empty or holds an engine")
    p.add_argument("--force", action="store_true",
                   help="--output holds other files: build into OUTPUT/MODEL instead (nothing in "
                        "OUTPUT is deleted)")
    add_source_args(p, ("device",), device=dict(choices=["cpu", "cuda"], help=None))
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    add_source_args(p, ("markov_sampler", "draft_vocab", "quantization", "draft_quantization", "tp_size",
                        "expert_parallel"),
                    markov_sampler=dict(default="exact", help="draft block sampler compiled in: exact "
                                        "full-vocabulary (default) or topk (fast candidate-restricted "
                                        "proposal, still lossless)"),
                    draft_vocab=dict(help="a draft-vocabulary file (`dspark-trt draft-vocab`): the draft "
                                          "block compiled over those tokens only"),
                    draft_quantization=dict(help="draft weights compiled in: none (default: --dtype) or fp8 "
                                                 "(its attention / MLP projections in fp8 e4m3, 128x128 block "
                                                 "scales, weight-only)"),
                    tp_size=dict(help="tensor-parallel ranks: one engine part per rank (rank0/, rank1/, "
                                      "...); the ranks are started here unless already launched by torchrun"),
                    expert_parallel=dict(help="with --tp-size: split MoE experts across the ranks by expert"))
    p.add_argument("--allow-reference-ops", action="store_true",
                   help="if building with the Triton plugin kernels fails, compile every dspark op "
                        "from its PyTorch reference instead of failing (slower engine; the manifest "
                        "and `dspark-trt info` say so)")
    p.add_argument("--skip-toolchain-check", action="store_true",
                   help="AOTI: skip building and loading a probe package with the C++ compiler "
                        "first (it catches compilers whose packages crash at load)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Build; SIGINT / SIGTERM stop it with nothing written (one line, exit code 130 / 143)."""
    import os
    import sys
    from ..interrupts import Interrupted, signals_raise_interrupted
    followers, rc = [], None
    try:
        with signals_raise_interrupted():
            if args.tp_size > 1 and "WORLD_SIZE" not in os.environ:   # not under torchrun: start the ranks
                from ..parallel.launch import spawn_ranks
                followers, env = spawn_ranks(args.tp_size, ["-m", "dspark_trt.cli", *args.argv])
                os.environ.update(env)
            rc = _build(args)
    except Interrupted as e:
        print(f"interrupted by {e.signal_name}: build stopped; its temporary files were removed "
              "and nothing was written", file=sys.stderr)
        rc = e.exit_code
    finally:
        if rc != 0:                     # failed or interrupted: the other ranks stop too
            _stop(followers)
    return max([rc] + [p.wait() for p in followers])


def _stop(procs, grace_s: float = 10.0) -> None:
    import subprocess
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()


def _build(args) -> int:
    from ..builder.build import BuildOptions, build_engine
    opts = BuildOptions.from_args(args, check_toolchain=not args.skip_toolchain_check)
    build_engine(opts, report=lambda msg: print(msg, flush=True))
    return 0
