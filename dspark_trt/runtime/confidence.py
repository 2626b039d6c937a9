"""Confidence-scheduled verification (paper §3.2, algorithm doc §3.5): how many drafts a row verifies.

Per request (``SamplingParams.verify_mode``):

* ``fixed``      verify all N drafts (the default; no confidence head needed).
* ``threshold``  DeepSpec's per-step rule: verify the drafts before the first position whose raw
                 confidence ``sigmoid(logit_k)`` is below ``confidence_threshold`` (0 drafts when it
                 is position 0).
* ``scheduled``  the paper's Algorithm 1 over all scheduled rows of the batch: prefix-survival
                 probabilities ``a_{r,k} = prod_{j<=k} c_{r,j}`` (calibrated ``c = sigmoid(logit / T_k)``)
                 are admitted greedily in descending order (stable: ties keep row-major order, so a
                 row's positions stay a prefix) while the expected throughput
                 ``Theta = tau * SPS(B)`` strictly grows; the first non-improving candidate stops the
                 search (the early stop that keeps the admission of draft k independent of x_k).
                 ``B`` = total verified tokens of the batch (1 + admitted per row, fixed / threshold
                 rows counted with their lengths), ``tau`` = expected committed tokens,
                 ``SPS(B) = 1 / latency(B)`` from a ``CostCurve`` (trimmed model with step
                 latencies: ``1 / (latency(B) + draft_ms + admission overhead)``, the whole round).

The admitted lengths are computed on the device from the confidence logits of the draft step (no
host synchronisation; inside the draft CUDA graph on the graph path). Verification of an admitted
prefix of ``l`` drafts stays exact: the verifier's acceptance is clamped to ``l`` and, when all ``l``
pass, the next token is sampled from the target row ``l`` (a bonus token), see
``steps.DecodeSteps.verify_step``. How many drafts the verify itself runs is the cost model's
(``verify_scheduler``; ``ModelSource.verify_cost_model``, "trimmed" by default): all N ("padded"),
the round's widest admitted window ("trimmed"), or each row's own prefix ("packed").

File (JSON, next to a draft checkpoint or in an engine directory):
``confidence_calibration.json``  {"temperatures": [T_0 .. T_{N-1}], "survival": [held-out
                                 P(drafts 0..k accepted)], "ece_before", "ece_after", ...}

Elsewhere: the verify cost curve in ``cost_curve.py``, the host-side scheduler (cost models, window
and AR-fallback decisions) in ``verify_scheduler.py``, the prefix-survival estimate in ``survival.py``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..atomic_write import write_json_atomic
from ..checkpoints.files import CALIBRATION_FILE

VERIFY_MODES = ("fixed", "threshold", "scheduled")
MODE_IDS = {m: i for i, m in enumerate(VERIFY_MODES)}


class ConfidenceFileError(ValueError):
    """A calibration or cost-curve file is malformed (the message names the file and field)."""


def read_json_file(path: Path) -> dict:
    """The JSON of a calibration or cost-curve file; ``ConfidenceFileError`` naming it if unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfidenceFileError(f"{path}: unreadable JSON ({e})") from None


# ---- calibration ----------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Per-position temperatures of Sequential Temperature Scaling: ``c_k = sigmoid(logit_k / T_k)``.
    Positions beyond the list use its last entry; no calibration = all 1."""

    temperatures: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def survival(self, n: int) -> np.ndarray | None:
        """[<= n] the held-out prefix survival ``P(drafts 0..k accepted)`` that ``dspark-trt
        calibrate`` measured (``"survival"``), None when the file has none (older calibrations)."""
        s = self.metrics.get("survival")
        return None if not s else np.asarray(s[:n], dtype=np.float64)

    def inv_temperatures(self, n: int, device) -> Tensor:
        t = [self.temperatures[min(k, len(self.temperatures) - 1)] if self.temperatures else 1.0
             for k in range(n)]
        return 1.0 / torch.tensor(t, dtype=torch.float32, device=device)

    def to_json(self) -> dict:
        return {"temperatures": list(map(float, self.temperatures)), **self.metrics}

    def save(self, directory: str | Path, name: str = CALIBRATION_FILE) -> Path:
        return write_json_atomic(Path(directory) / name, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        d = read_json_file(Path(path))
        t = d.get("temperatures")
        if not isinstance(t, list) or not t or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in t):
            raise ConfidenceFileError(f"{path}: 'temperatures' must be a non-empty list of positive "
                                      f"numbers, got {t!r}")
        s = d.get("survival")
        if s is not None and not (isinstance(s, list) and all(
                isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in s)):
            raise ConfidenceFileError(f"{path}: 'survival' must be a list of probabilities in [0, 1], "
                                      f"got {s!r}")
        return cls([float(v) for v in t], {k: v for k, v in d.items() if k != "temperatures"})

    @classmethod
    def find(cls, *directories, name: str = CALIBRATION_FILE) -> "Calibration | None":
        """The first of ``directories`` holding ``name`` (``checkpoints.files.calibration_file``)."""
        for d in directories:
            if d is not None and (Path(d) / name).exists():
                return cls.load(Path(d) / name)
        return None


# ---- admission --------------------------------------------------------------------------------------

def admitted_lengths(conf_logits: Tensor, live: Tensor, mode: Tensor, threshold: Tensor,
                     inv_temp: Tensor, sps: Tensor, padded_width: int | None = None,
                     trimmed: bool = False, round_ms: Tensor | None = None,
                     window_sps: Tensor | None = None) -> Tensor:
    """How many drafts each row verifies -> [B] int64 in [0, N] (0 for rows that are not live).

    conf_logits [B, N] (confidence logits of the drafted block), live [B] bool, mode [B] int64
    (``MODE_IDS``), threshold [B] float (threshold rows), inv_temp [N] (1 / T_k of the
    calibration), sps [M] (``CostCurve.sps_table``; token counts beyond M - 1 use the last entry).

    ``padded_width``: the cost model of Algorithm 1's ``B``. None = packed (the paper's: a row
    costs ``1 + l_r`` tokens, what a variable-length verify would run); an int ``w`` = padded (every
    live row costs ``1 + w`` tokens whatever it admits, what a verify padded to ``w`` drafts runs),
    so ``SPS(B)`` is one constant and every candidate that raises ``tau`` is admitted.
    ``trimmed`` (with ``padded_width`` None): every live row costs ``1 + w`` tokens for the
    window ``w = max_r l_r``, what the verify trimmed to the longest admitted prefix runs; the
    candidates are then the window's widths (``_trimmed_lengths``). ``round_ms`` [R] (trimmed
    and packed): the round's cost outside the verify at r live rows (draft step + admission and
    host overheads, ``VerifyScheduler``), added to ``1 / SPS(B)`` so that Theta is tokens per ms
    of the whole round.

    ``window_sps`` [R, N] (trimmed only, ``VerifyScheduler.window_sps_table``): ``1 / latency`` of
    the verify of r rows at window w, used instead of ``sps`` at ``r x (1 + w)`` tokens when the
    cost curve has its ``verify_ms`` grid.

    Tensor ops only (sort, cumsum, cumprod, gathers): no host synchronisation, capturable in a
    CUDA graph.
    """
    B, N = conf_logits.shape
    dev = conf_logits.device
    c_raw = torch.sigmoid(conf_logits.float())
    a = torch.cumprod(torch.sigmoid(conf_logits.float() * inv_temp[None, :N]), 1)    # [B, N]
    a = torch.where(live[:, None], a, 0.0)
    fixed = torch.full((B,), N, dtype=torch.int64, device=dev)
    thr = torch.cumprod((c_raw >= threshold[:, None]).to(torch.int64), 1).sum(1)
    length = torch.where(mode == MODE_IDS["threshold"], thr, fixed)
    sched = live & (mode == MODE_IDS["scheduled"])
    length = torch.where(live & ~sched, length, 0)
    # Algorithm 1 over the scheduled rows; the other live rows are a fixed load
    k = torch.arange(N, device=dev)
    other = live & ~sched
    tau0 = (sched.sum() + (other * (1 + (a * (k[None] < length[:, None])).sum(1))).sum()).float()
    if trimmed and padded_width is None:
        return _trimmed_lengths(a, live, sched, other, length, tau0, sps, round_ms, window_sps)
    b0 = sched.sum() + (other * (1 + length)).sum()
    cand = torch.where(sched[:, None] & (a > 0), a, -1.0).reshape(-1)
    vals, order = torch.sort(cand, descending=True, stable=True)
    valid = vals > 0
    tau = tau0 + torch.cumsum(vals.clamp(min=0), 0)
    M = sps.shape[0]
    b = (b0 + 1 + torch.arange(B * N, device=dev)).clamp(max=M - 1)
    b0 = b0.clamp(max=M - 1)
    if padded_width is not None:                 # every live row pays 1 + w whatever it admits
        b0 = (live.sum() * (1 + padded_width)).clamp(max=M - 1)
        b = b0.expand(B * N)
    # Theta = tau * SPS(B) grows  <=>  a * SPS(b) > tau_prev * (SPS(b_prev) - SPS(b)): the same test
    # written so that a constant SPS (the padded model) admits every a > 0 despite float rounding
    s_b, s0 = sps[b], sps[b0.reshape(1)]                  # (sps[b0] on a 0-dim index syncs)
    if round_ms is not None and padded_width is None:     # packed: whole-round SPS, as trimmed
        s_b, s0 = _whole_round(s_b, s0, round_ms, live.sum())
    s_prev = torch.cat([s0, s_b[:-1]])
    tau_prev = torch.cat([tau0[None], tau[:-1]])
    improve = valid & (vals.clamp(min=0) * s_b > tau_prev * (s_prev - s_b))
    K = torch.cumprod(improve.to(torch.int64), 0).sum()
    take = torch.zeros(B * N, dtype=torch.int64, device=dev).scatter_(
        0, order, (torch.arange(B * N, device=dev) < K).to(torch.int64))
    return torch.where(sched, take.view(B, N).sum(1), length)


def _whole_round(s_b: Tensor, s0: Tensor, round_ms: Tensor, n_live: Tensor) -> tuple[Tensor, Tensor]:
    """The verify's SPS values as whole-round ones: ``1 / (1 / SPS + round_ms[n_live])`` (verify +
    draft + overheads at ``n_live`` rows, a 0-dim count read as a 1-element index: no sync)."""
    extra = round_ms[n_live.clamp(max=round_ms.shape[0] - 1).reshape(1)]                  # [1]
    return 1.0 / (1.0 / s_b + extra), 1.0 / (1.0 / s0 + extra)


def _trimmed_lengths(a: Tensor, live: Tensor, sched: Tensor, other: Tensor, length: Tensor,
                     tau0: Tensor, sps: Tensor, round_ms: Tensor | None = None,
                     window_sps: Tensor | None = None) -> Tensor:
    """Algorithm 1 for a verify trimmed to one window ``w`` of the batch: the candidates are the
    widths w = 1 .. N in order, width w adding ``sum_r a_{r,w-1}`` over the scheduled rows to tau
    and costing ``B(w) = live x (1 + max(w, m0))`` (m0: the longest fixed / threshold row, the
    window's least 1); admitted while ``tau * SPS(B)`` strictly grows, first non-improving width
    stops; ``round_ms[live]`` (the draft step + overhead) is added to each width's verify latency.
    Every scheduled row verifies the admitted width (its drafts below the window cost
    nothing more). Non-anticipating: admitting width w reads ``a_{., w-1}``, i.e. confidences up
    to position w-1, which read drafts before w-1 only. -> [B] int64."""
    B, N = a.shape
    M = sps.shape[0]
    n_live = live.sum()
    m0 = torch.where(other, length, 0).max().clamp(min=1)                   # 0-dim
    w = torch.arange(1, N + 1, device=a.device)
    gain = (a * sched[:, None]).sum(0)                                       # [N]: level w-1
    tau = tau0 + torch.cumsum(gain, 0)
    if window_sps is None:
        b = (n_live * (1 + torch.maximum(w, m0))).clamp(max=M - 1)         # [N]
        b0 = (n_live * (1 + m0)).clamp(max=M - 1)
        s_b, s0 = sps[b], sps[b0.reshape(1)]
    else:                                        # by rows and width: [rows, N] table
        r = n_live.clamp(max=window_sps.shape[0] - 1).reshape(1)          # (a 0-dim index syncs)
        s_b = window_sps[r, torch.maximum(w, m0) - 1]                      # [N]
        s0 = window_sps[r, (m0 - 1).reshape(1)]                            # [1]
    if round_ms is not None:
        s_b, s0 = _whole_round(s_b, s0, round_ms, n_live)
    s_prev = torch.cat([s0, s_b[:-1]])
    tau_prev = torch.cat([tau0[None], tau[:-1]])
    improve = (gain > 0) & (gain * s_b > tau_prev * (s_prev - s_b))
    K = torch.cumprod(improve.to(torch.int64), 0).sum()
    return torch.where(sched, K, length)
