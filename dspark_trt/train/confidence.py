"""DeepSpec's confidence head for the DSpark draft (paper eq. 7), trained alongside the draft.

``c_k = sigmoid(w · [h_k ; W1[x_{k-1}]] + b)``: h_k [.., d] is the draft's post-norm hidden state
of block row k, W1[x_{k-1}] [.., r] the Markov head's embedding of the previous token
(teacher-forced in training). Trained with BCE towards ``c*_k = 1 - ½‖p_d - p_t‖₁`` (detached;
the T = 1 acceptance probability of row k), weighted like the draft loss, weight 1.0.

It is saved beside the draft as ``confidence_head.safetensors`` (not in the checkpoint index) under
the published names ``confidence_head.proj.{weight,bias}``; the runtime's Qwen3 loader
(``checkpoints/qwen3.py``) reads that side file when the checkpoint itself has no head, so a
trained draft directory runs the confidence modes as it is. Older side files with the keys
``confidence_head.{weight,bias}`` load too.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

FILE = "confidence_head.safetensors"


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)          # with bias (Qwen3 DSpark)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: Tensor, w1_prev: Tensor) -> Tensor:
        """h [..., d], w1_prev [..., r] -> confidence logits [...]."""
        return self.proj(torch.cat([h, w1_prev.to(h.dtype)], -1)).squeeze(-1)

    def save(self, draft_dir: Path) -> None:
        save_file({"confidence_head.proj.weight": self.proj.weight.detach().to(torch.bfloat16).cpu(),
                   "confidence_head.proj.bias": self.proj.bias.detach().to(torch.bfloat16).cpu()},
                  str(Path(draft_dir) / FILE), metadata={"format": "pt"})


def confidence_loss(logits: Tensor, accept: Tensor, w: Tensor) -> dict[str, Tensor]:
    """logits, accept (c*, detached), w [B, A, N] -> {'bce', 'abs_err'} (weighted means)."""
    bce = F.binary_cross_entropy_with_logits(logits.float(), accept.detach(), reduction="none")
    den = w.sum().clamp(min=1e-6)
    return {"bce": (bce * w).sum() / den,
            "abs_err": ((logits.detach().float().sigmoid() - accept).abs() * w).sum() / den}


def load_confidence(draft_dir: Path, recipe, device) -> ConfidenceHead | None:
    """The head saved beside a draft (None if there is none)."""
    from safetensors.torch import load_file
    path = Path(draft_dir) / FILE
    if not path.exists():
        return None
    t = load_file(str(path))
    head = ConfidenceHead(recipe.hidden_size, recipe.markov_rank)
    get = lambda k: t.get(f"confidence_head.proj.{k}", t.get(f"confidence_head.{k}"))  # noqa: E731
    head.proj.weight.data.copy_(get("weight").float())
    head.proj.bias.data.copy_(get("bias").float())
    return head.to(device).eval().requires_grad_(False)
