"""Global expert ids -> this rank's local ids, for ``dspark::moe_experts``'s reference and kernel."""
from __future__ import annotations

from torch import Tensor


def local_experts(expert_ids: Tensor, first_expert: int, num_experts: int) -> tuple[Tensor, Tensor]:
    """expert_ids (global, any shape) -> (local ids int64, live mask): a slot is live when its id is
    not -1 and falls in this rank's block ``[first_expert, first_expert + num_experts)``."""
    local = expert_ids.long() - first_expert
    return local, (expert_ids >= 0) & (local >= 0) & (local < num_experts)
