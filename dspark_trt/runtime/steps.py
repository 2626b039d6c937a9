"""The decode steps of one round as fused functions over a networks object (eager reference).

A round is two steps, each a fixed-shape function of device tensors (so each can be captured as
one CUDA graph, see ``cuda_graphs.py``):

  draft_step   (anchor, start, table, temperature, seed)       -> drafts [B, N], z [B, N, V]
  verify_step  (+ drafts, z, top_p)                            -> out [B, 2 + N] = (accepted, next, drafts)
               target over [anchor, drafts] at P .. P+N, top-p, on-device acceptance, then the
               context injection of verify rows 0..a (rows > a at position -1: fixed shape N+1)
  ar_step      (anchor, start, table, temperature, top_p, seed) -> out [B, 1] = next token

The context injection ends the verify step (rather than starting the next draft step) so that no
device state is carried between rounds: rows may join, leave or reorder freely between rounds.
Rows with ``start < 0`` are inert (they write nothing and return -1 / 0 accepted).
A live row whose target logits hold NaN or Inf returns accepted = -1 (verify) or token -1 (AR):
one ``isfinite`` reduction of the logits per step, read back with the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .. import plugins


@dataclass
class RoundInputs:
    """Host-side (numpy) inputs of one round for B rows."""

    anchor: np.ndarray        # [B] int64: last committed token (its target KV is not written yet)
    start: np.ndarray         # [B] int64: P, the anchor's position
    seed: np.ndarray          # [B] int64
    temperature: np.ndarray   # [B] float32
    top_p: np.ndarray         # [B] float32
    table: np.ndarray         # [B, max_pages] int64 page ids, -1 padded

    @property
    def batch_size(self) -> int:
        return int(self.anchor.shape[0])


@dataclass
class DeviceInputs:
    """The same inputs as device tensors (views into one static buffer on the graph path)."""

    anchor: Tensor
    start: Tensor
    seed: Tensor
    temperature: Tensor
    top_p: Tensor
    table: Tensor

    @classmethod
    def from_host(cls, r: RoundInputs, device) -> "DeviceInputs":
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return cls(t(r.anchor), t(r.start), t(r.seed), t(r.temperature), t(r.top_p), t(r.table))


class DecodeSteps:
    """The fused steps over ``networks`` (EagerNetworks or an engine with the same interface)."""

    def __init__(self, networks):
        self.nets = networks
        self.device = networks.device
        self.num_spec_tokens = networks.num_spec_tokens

    # ---- the steps (device tensors in, device tensors out; no host synchronisation) -------------
    @torch.inference_mode()
    def draft_step(self, x: DeviceInputs) -> tuple[Tensor, Tensor]:
        """Draft block + Markov sampler -> drafts [B, N] i64, proposal logits z [B, N, V] f32."""
        return self.nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed)

    @torch.inference_mode()
    def verify_step(self, x: DeviceInputs, drafts: Tensor, z: Tensor, use_top_p: bool) -> Tensor:
        """Target verify + acceptance + context injection -> [B, 2 + N] (accepted, next, drafts)."""
        N = self.num_spec_tokens
        offs = torch.arange(N + 1, device=x.start.device)
        live = (x.start >= 0)[:, None]
        pos = torch.where(live, x.start[:, None] + offs, -1)                       # [B, N+1]
        logits, taps = self.nets.target(torch.cat([x.anchor[:, None], drafts], 1), pos, x.table)
        finite = torch.isfinite(logits).all(dim=-1).all(dim=-1)                   # [B]
        if use_top_p:
            logits = plugins.apply_top_p(logits, x.temperature, x.top_p)
        accepted, nxt = self.nets.verify(logits, drafts, z, x.temperature, x.seed, x.start)
        ctx_pos = torch.where(offs[None, :] <= accepted[:, None], pos, -1)          # [B, N+1]
        self.nets.draft_context(taps, ctx_pos, x.table)
        flagged = torch.where(finite, accepted, -1)                                 # -1: not finite
        return torch.cat([flagged[:, None], nxt[:, None], drafts], 1)

    @torch.inference_mode()
    def ar_step(self, x: DeviceInputs, use_top_p: bool) -> Tensor:
        """One autoregressive target step -> next token [B, 1] (-1 for inert rows)."""
        pos = torch.where(x.start >= 0, x.start, -1)[:, None]                       # [B, 1]
        logits, _ = self.nets.target(x.anchor[:, None], pos, x.table)
        logits = logits[:, 0]
        finite = torch.isfinite(logits).all(dim=-1)                                 # [B]
        if use_top_p:
            logits = plugins.apply_top_p(logits, x.temperature, x.top_p)
        nxt = plugins.sample_tokens(logits, x.temperature, x.seed, x.start + 1)
        return torch.where((x.start >= 0) & finite, nxt, -1)[:, None]

    # ---- one round from host inputs to host outputs (the single synchronisation) ----------------
    def spec_round(self, r: RoundInputs, use_top_p: bool) -> np.ndarray:
        """-> [B, 2 + N] int64 on the host: accepted (-1: non-finite logits), next token, drafts."""
        x = DeviceInputs.from_host(r, self.device)
        drafts, z = self.draft_step(x)
        return self.verify_step(x, drafts, z, use_top_p).cpu().numpy()

    def ar_round(self, r: RoundInputs, use_top_p: bool) -> np.ndarray:
        """-> [B, 1] int64 on the host: the next token (-1: non-finite logits)."""
        return self.ar_step(DeviceInputs.from_host(r, self.device), use_top_p).cpu().numpy()
