"""``dspark-trt train``: train the target, DSpark, DFlash and AR drafts into one directory."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small target + DSpark draft (and baselines) on the "
                                     "Python standard library")
    p.add_argument("--output", required=True, help="run directory (checkpoints, summary, plots)")
    p.add_argument("--preset", default="h200", help="training recipe: h200 (default) or smoke")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--minutes-budget", type=float, default=None,
                   help="wall-clock budget for the whole run (default: the preset's)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dflash-objective", choices=["ce", "same"], default=None,
                   help="ce: DeepSpec's DFlash baseline (CE only); same: DSpark's CE + L1 mix")
    p.add_argument("--no-autocast", action="store_true", help="fp32 training on CUDA")
    p.add_argument("--stdlib", default=None, help="read sources from here instead of the "
                                                  "interpreter's stdlib directory")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    from ..train.pipeline import train_all
    from ..train.recipe import get_recipe
    try:
        recipe = get_recipe(args.preset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.minutes_budget is not None:
        recipe.minutes_budget = args.minutes_budget
    if args.seed is not None:
        recipe.seed = args.seed
    if args.dflash_objective is not None:
        recipe.dflash_objective = args.dflash_objective
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda given but CUDA is not available")
    torch.set_float32_matmul_precision("high")
    train_all(recipe, args.output, device=device, autocast=not args.no_autocast,
              stdlib_root=args.stdlib, log=lambda m: print(m, flush=True))
    return 0
