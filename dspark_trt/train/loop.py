"""One optimisation loop (AdamW, warmup + cosine, grad clip) with a time budget and a loss log."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..progress import bar
from .objective import lr_at
from .recipe import Schedule

CALIBRATE = (5, 15)   # steps between which the step time is measured (after warm-up effects)


@dataclass
class History:
    """Loss log of one model: training loss per step, held-out metrics at eval points."""

    name: str
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    total_steps: int = 0
    seconds: float = 0.0
    step_seconds: float = 0.0
    stopped_by_time: bool = False
    trainable_params: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _optimizer(params: list[torch.nn.Parameter], sched: Schedule) -> torch.optim.AdamW:
    """AdamW with the schedule's betas; weight decay on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW([{"params": decay, "weight_decay": sched.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=sched.lr,
                             betas=tuple(sched.betas), fused=fused)


def warmup_steps(sched: Schedule, total: int) -> int:
    return max(1, round(sched.warmup_frac * total)) if sched.warmup_frac is not None else sched.warmup


def run_training(name: str, params: list[torch.nn.Parameter], step_loss: Callable[[], Tensor],
                 evaluate: Callable[[], dict], sched: Schedule, budget_s: float, device,
                 log: Callable[[str], None] = print,
                 on_eval: Callable[[int, dict], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> History:
    """Minimise ``step_loss()`` (one fresh batch per call) for ``sched.steps`` steps, or for as many
    as fit in ``budget_s`` seconds (the step time is measured over steps 5..15, evaluations
    excluded); ``evaluate()`` runs at ``sched.eval_points`` evenly spaced steps and at the end,
    and ``on_eval(step, metrics)`` after each (e.g. to keep the best checkpoint). ``clock`` gives
    seconds (tests pass a simulated one so the budget does not depend on machine load)."""
    params = [p for p in params if p.requires_grad]
    hist = History(name, trainable_params=sum(p.numel() for p in params))
    opt = _optimizer(params, sched)
    calibrating = sched.steps is None
    total = sched.steps if not calibrating else max(CALIBRATE[1] + 1, sched.warmup * 2)
    # no evaluation before the step time is known: it would be timed as training (#18)
    eval_every = max(1, total // sched.eval_points) if not calibrating else total + 1
    eval_s = 0.0                                  # seconds spent in evaluate() so far
    losses: list[Tensor] = []
    t0 = clock()
    t_cal = t0
    step = 0
    log(f"[train] {name}: {hist.trainable_params / 1e6:.2f} M trainable parameters, "
        + (f"{total} steps" if sched.steps is not None else f"budget {budget_s:.0f} s"))
    progress = bar(total=total, desc=f"train {name}", unit="step")
    while step < total:
        if sched.steps is None and step in CALIBRATE:
            _sync(device)
            if step == CALIBRATE[0]:
                t_cal, eval_cal = clock(), eval_s
            else:
                window = clock() - t_cal - (eval_s - eval_cal)
                hist.step_seconds = window / (CALIBRATE[1] - CALIBRATE[0])
                left = budget_s - (clock() - t0)
                # ~5 % of the budget goes to evaluations and logging
                total = max(step + 1, step + int(0.95 * left / hist.step_seconds))
                progress.total = total
                eval_every = max(1, total // sched.eval_points)
                log(f"[train] {name}: {hist.step_seconds * 1e3:.1f} ms/step -> {total} steps")
        lr = lr_at(step, total, sched.lr, warmup_steps(sched, total), sched.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = step_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        hist.steps.append(step)
        hist.lr.append(lr)
        step += 1
        progress.update()
        if step % eval_every == 0 or step == total:
            hist.train_loss += torch.stack(losses).float().cpu().tolist()
            losses = []
            t_eval = clock()
            metrics = evaluate()
            _sync(device)
            eval_s += clock() - t_eval
            hist.eval_steps.append(step)
            hist.eval.append(metrics)
            if on_eval is not None:
                on_eval(step, metrics)
            elapsed = clock() - t0
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            log(f"[train] {name} step {step}/{total} ({elapsed:.0f} s): train loss "
                f"{hist.train_loss[-1]:.4f}; held-out {shown}")
            if sched.steps is None and elapsed > 1.1 * budget_s and step < total:
                hist.stopped_by_time = True
                log(f"[train] {name}: time budget exceeded, stopping at step {step}")
                break
    progress.close()
    if losses:
        hist.train_loss += torch.stack(losses).float().cpu().tolist()
    _sync(device)
    hist.total_steps, hist.seconds = step, clock() - t0
    return hist
