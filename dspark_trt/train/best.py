"""Keep the parameters of the evaluation with the lowest held-out loss (early-stopping style)."""
from __future__ import annotations

import math

import torch
from torch import nn


class BestCheckpoint:
    """``update(step, metrics)`` after each evaluation; ``restore()`` loads the best state back.

    The state is copied to the CPU only when ``metrics[metric]`` is strictly below every earlier
    value (ties keep the earlier, shorter-trained state).
    """

    def __init__(self, module: nn.Module, metric: str = "ce"):
        self.module, self.metric = module, metric
        self.best_value, self.best_step = math.inf, -1
        self.state: dict[str, torch.Tensor] | None = None

    def update(self, step: int, metrics: dict) -> bool:
        value = float(metrics[self.metric])
        if not value < self.best_value:
            return False
        self.best_value, self.best_step = value, step
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        return True

    def restore(self) -> int:
        """Load the best state into the module; -> its step (-1 if there was no evaluation)."""
        if self.state is not None:
            self.module.load_state_dict(self.state)
        return self.best_step
