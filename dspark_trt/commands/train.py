"""``dspark-trt train``: the default pair (target + DSpark draft) and the DFlash / AR baselines,
trained in resumable stages into one output directory (``train/stages.py``)."""
from __future__ import annotations

from ..config.source import add_source_args


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small target + DSpark draft (and baselines) on "
                                     "Python sources, in resumable stages")
    p.add_argument("--output", required=True, help="run directory (resumed if it exists)")
    p.add_argument("--stage", nargs="+", default=["all"],
                   choices=["target", "distill", "drafts", "eval", "all"],
                   help="stages to run, in order (finished ones are skipped; default: all)")
    p.add_argument("--preset", default="h200", help="training recipe: h200 (default) or smoke")
    add_source_args(p, ("device",))
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock budget of this call: no stage starts after it, and the target "
                        "stage stops training in time (default: none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None,
                   help="steps of every draft (default: the preset's; part of the recipe, so give "
                        "it to every call of a run)")
    p.add_argument("--target-minutes", type=float, default=None,
                   help="training-time cap of the target (default: the preset's; part of the recipe)")
    p.add_argument("--no-autocast", action="store_true", help="fp32 training on CUDA")
    p.add_argument("--corpus-root", action="append", default=None, metavar="NAME=DIR",
                   help="corpus roots instead of the stdlib + installed packages (repeatable; "
                        "only read when the run directory has no corpus manifest yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    import torch
    from ..train.recipe import get_recipe
    from ..train.stages import StageError, run_stages
    try:
        recipe = get_recipe(args.preset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.seed is not None:
        recipe.seed = args.seed
    if args.draft_steps is not None:
        if args.draft_steps < 1:
            raise SystemExit(f"error: --draft-steps must be >= 1, got {args.draft_steps}")
        recipe.drafts = dataclasses.replace(recipe.drafts, steps=args.draft_steps)
        recipe.dspark = recipe.dflash = recipe.ar = recipe.drafts
    if args.target_minutes is not None:
        recipe.target = dataclasses.replace(recipe.target, minutes=args.target_minutes)
    roots = None
    if args.corpus_root:
        bad = [r for r in args.corpus_root if "=" not in r]
        if bad:
            raise SystemExit(f"error: --corpus-root takes NAME=DIR, got {bad[0]!r}")
        roots = dict(r.split("=", 1) for r in args.corpus_root)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda given but CUDA is not available")
    torch.set_float32_matmul_precision("high")
    try:
        run_stages(recipe, args.output, args.stage, device=device, autocast=not args.no_autocast,
                   roots=roots, minutes=args.minutes, log=lambda m: print(m, flush=True))
    except StageError as e:
        raise SystemExit(f"error: {e}") from None
    return 0
