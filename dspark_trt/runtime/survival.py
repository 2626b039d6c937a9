"""The prefix-survival estimate of the recent speculative rounds (``SurvivalEstimate``), what the
scheduler's decisions read.
"""
from __future__ import annotations

from collections import deque

import numpy as np


def censored_odds(risk: np.ndarray, surv: np.ndarray, acc: np.ndarray, ver: np.ndarray, c: np.ndarray) -> None:
    """Add to the Kaplan-Meier counts ``risk`` / ``surv`` [rows, N] (rows that reached and verified
    draft k / accepted it) what the calibrated conditional confidences ``c`` [rows, w] say of the
    drafts a row did not verify after accepting all it did (``acc == ver < w``): it reaches draft
    k >= ver with probability ``prod_{ver<=j<k} c_j`` and accepts it with ``prod_{ver<=j<=k} c_j``.
    Where each row's window is its own admitted prefix (packed rounds; a narrowed head) the
    censoring is informative: the rows verified furthest are the confident ones, and counting only
    them made the tail's conditional acceptance near 1 (replayed H100 run at batch 64: estimated
    survival 0.14 at draft 7 against the replay's ~0.1). With the head's odds the counts telescope
    to the mean survival the calibration predicts."""
    w = c.shape[1]
    k = np.arange(w)[None]                                                       # [1, w]
    open_ = (acc == ver)[:, None] & (k >= ver[:, None])                         # [rows, w]
    if not open_.any():
        return
    odds = np.cumprod(np.where(open_, c, 1.0), axis=1)                          # prod_{ver<=j<=k} c_j
    reach = np.concatenate([np.ones((len(c), 1)), odds[:, :-1]], axis=1)        # prod_{ver<=j<k} c_j
    risk[:, :w] += np.where(open_, reach, 0.0)
    surv[:, :w] += np.where(open_, odds, 0.0)


class SurvivalEstimate:
    """Prefix-survival curve of the recent speculative rounds from their verified outcomes
    (Kaplan-Meier with the verify window as censoring): per position k, ``at_risk_k`` rows reached
    draft k and verified it, ``survived_k`` of them accepted it (plus, where the round ran the head,
    the odds of the drafts its rows did not verify: ``censored_odds``); conditional acceptance
    ``h_k = (survived_k + PRIOR_WEIGHT * prior_k) / (at_risk_k + PRIOR_WEIGHT)`` and ``curve[k] =
    prod_{j<=k} h_j``. The prior ``prior_k = S_k / S_{k-1}`` is the head's own prediction of the
    conditional acceptance, known for every position whatever the window verified: ``S_k`` the mean
    over the recent confidence rounds' rows of the calibrated prefix product ``prod_{j<=k} c_{r,j}``
    (``S_{-1} = 1``), ``PRIOR`` before any. Not the mean of ``c_{r,k}`` itself: a row's confidences
    are correlated across positions (an easy continuation is easy throughout), so the rows that
    survive to k are the confident ones, and the mean conditional under-states the tail (replayed
    H200 curve: tau 1.81 against the true 2.41), which kept censored windows looking right. Before
    any confidence round ``S`` is ``measured`` where given (the calibration's held-out survival,
    ``Calibration.survival``), else the constant ``PRIOR``. Counts of the last
    ``window`` rounds; AR rounds (nothing verified) add nothing, so the estimate is not pulled
    down by them, and a few unlucky rounds at batch 1 do not read as a curve of zeros, but they
    age the window (``age``). Rounds that leave the window keep counting, decayed, in the prior
    (``HISTORY_DECAY``)."""

    PRIOR, PRIOR_WEIGHT = 0.5, 4.0
    # Rounds leaving the window join a history (each earlier round's weight times HISTORY_DECAY per
    # round that leaves after it: ~100 rounds' memory) that the prior leans on as counts: the
    # calibration's curve and the head's confidences are calibrated at one temperature, and greedy
    # requests of the default pair accept more (hazards 0.55, 0.49, 0.67, ... against the curve's
    # 0.45, 0.40, 0.40, ...: 1.23 accepted drafts a round against 0.74), which kept a batch-1 window's
    # estimate at ~0.99 and the batch in AR rounds (session 43).
    HISTORY_DECAY = 0.99
    # The AR fallback's evidence (``optimistic``): the expected accepted drafts at their one-sided
    # 95 % upper bound. A streak, once started, runs until a probe (hundreds of rounds where probes
    # are dear), so it starts only where AR wins even against that bound.
    UPPER_Z = 1.645
    # Once the window is full the curve is estimated again every REFRESH rounds, not every round:
    # each round's decisions read it, and on a round of ~1.5 ms (the default pair on the H200) the
    # estimate and the decisions that follow from it were 0.1-0.2 ms of host time; a full window
    # moves by at most REFRESH / window of its rounds in between.
    REFRESH = 4
    # ``forget`` of at least this share of the batch drops the curve at once (batch 1, 2: the next
    # round's decision is about the requests that stayed); smaller shares mark it due.
    FORGET_NOW = 0.5

    def __init__(self, num_spec_tokens: int, window: int = 32, measured: np.ndarray | None = None,
                 refresh: int = REFRESH):
        """``measured``: [<= N] a prefix-survival curve measured on held-out data; with it the
        estimate holds before any round (``informed``): a fresh scheduler decides from it.
        ``refresh``: rounds between estimates once the window is full (1: every round)."""
        self.n, self.refresh = num_spec_tokens, max(1, int(refresh))
        self.measured = None if measured is None or not len(measured) else np.asarray(measured, np.float64)
        self.rounds: deque = deque(maxlen=window)        # (at_risk [N], survived [N]) per round
        self.confidence: deque = deque(maxlen=window)    # (sum_r prod_{j<=k} c_{r,j} [N], rows)
        # running sums of both windows (the rounds' decisions read the curve every round)
        self._risk, self._surv = np.zeros(self.n), np.zeros(self.n)
        self._hist_risk, self._hist_surv = np.zeros(self.n), np.zeros(self.n)   # rounds past the window
        self._conf, self._conf_rows = np.zeros(self.n), 0
        self._curve: np.ndarray | None = None
        self._upper: np.ndarray | None = None            # ``optimistic``, of the same counts as the curve
        self._stale = 0                                  # rounds added since the curve was estimated
        self._due = False                                # the curve is to be estimated again
        self._held = False                               # prepare()d: the next add keeps the curve
        self._last_confidence: np.ndarray | None = None  # [rows, N] of the latest round with the head
        self._version = 0                                # curves dropped (``version``)
        self._pending: tuple | None = None               # a deferred add: (accepted, verified, confidence)
        self._forget_carry = 0.0                         # ``forget``'s fraction of a round not yet retired

    def __len__(self) -> int:
        return min(len(self.rounds) + (self._pending is not None), self.rounds.maxlen)

    @property
    def informed(self) -> bool:
        """Whether the curve rests on anything measured: verified rounds or the ``measured`` prior."""
        return bool(self.rounds) or self._pending is not None or self.measured is not None \
            or bool(self._hist_risk.any())

    @property
    def dropped(self) -> bool:
        """Whether the curve was dropped (the next ``curve`` estimates it)."""
        return self._curve is None

    @property
    def fresh(self) -> bool:
        """Whether no round was added yet (none in the window, deferred or in the history)."""
        return not self.rounds and self._pending is None and not self._hist_risk.any()

    @property
    def last_confidence(self) -> np.ndarray | None:
        """[rows, N] the calibrated confidences of the latest round with the head (deferred or not;
        the same array object until another such round)."""
        if self._pending is not None and self._pending[2] is not None and self._pending[2].shape[1] == self.n:
            return self._pending[2]
        return self._last_confidence

    @property
    def version(self) -> int:
        """Counts the curves dropped: each makes the next ``curve`` a new array, and the scheduler's
        decision tables (``VerifyScheduler.row_choices``) key on the array."""
        if self._pending is not None and not self._held:     # the deferred add may drop the curve
            self.flush()
        return self._version

    def add(self, accepted, verified, confidence=None, now: bool = False, defer: bool = False) -> None:
        """One round: per row, drafts accepted and drafts verified (accepted <= verified <= N);
        ``confidence`` [rows, N]: the rows' calibrated conditional confidences, if the round ran
        the head ([rows, h] of a head narrowed to h drafts: they weigh its rows' unverified drafts,
        ``censored_odds``, but leave the prior and ``last_confidence`` as they were). ``now``: the
        next ``curve`` takes this round in whatever the refresh and a ``prepare`` say (a probe of an
        AR streak, whose outcome the next decision is to read). ``defer`` (not with ``now``): keep
        the round until the estimate is next read or prepared (``Scheduler``: the next round's host
        work, while that round runs on the device), one round at most; every read returns what it
        would have after an immediate ``add``."""
        c = None
        if confidence is not None and len(confidence):
            c = np.asarray(confidence, dtype=np.float64)[:, : self.n]               # [rows, N]
        self.flush()
        if defer and not now:
            self._pending = (accepted, verified, c)
        else:
            self._add(accepted, verified, c, now)

    def flush(self) -> None:
        """Apply a deferred ``add`` now (``Scheduler``: the host work of a round that decides
        nothing, e.g. a fixed-N round, so the bookkeeping still runs while the device works)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._add(*pending, now=False)

    def _add(self, accepted, verified, c: np.ndarray | None, now: bool) -> None:
        acc, ver = np.asarray(accepted)[:, None], np.asarray(verified)[:, None]
        k = np.arange(self.n)[None]
        filling = len(self.rounds) < self.rounds.maxlen
        if not filling:
            self._retire_oldest()
        risk, surv = ((acc >= k) & (ver > k)).astype(np.float64), (acc > k).astype(np.float64)
        if c is not None:
            censored_odds(risk, surv, acc[:, 0], ver[:, 0], c)
        new = (risk.sum(0), surv.sum(0))
        self.rounds.append(new)
        self._risk, self._surv = self._risk + new[0], self._surv + new[1]
        if c is not None and c.shape[1] == self.n:       # a narrowed head's: no prior past its drafts
            if len(self.confidence) == self.confidence.maxlen:
                old_sum, old_rows = self.confidence[0]
                self._conf, self._conf_rows = self._conf - old_sum, self._conf_rows - old_rows
            self._last_confidence = c                                               # [rows, N]
            prefix = np.cumprod(c, axis=1).sum(0)                                   # [N]
            self.confidence.append((prefix, c.shape[0]))
            self._conf, self._conf_rows = self._conf + prefix, self._conf_rows + c.shape[0]
        self._stale += 1
        self._due = self._due or filling or self._stale >= self.refresh or now
        if self._due and (now or not self._held):
            self._drop()
        self._held = False

    def _retire_oldest(self) -> None:
        """The window's oldest round leaves it for the history (``HISTORY_DECAY``)."""
        old = self.rounds.popleft()
        self._risk, self._surv = self._risk - old[0], self._surv - old[1]
        self._hist_risk = self.HISTORY_DECAY * self._hist_risk + old[0]
        self._hist_surv = self.HISTORY_DECAY * self._hist_surv + old[1]

    def age(self, rounds: int) -> None:
        """``rounds`` rounds ran that verified nothing (an AR streak's): as many of the window's
        oldest rounds leave it for the history, so the window spans the batch's last ``window``
        rounds of any kind, not its last speculative ones. Without this a streak's window held
        the rows from before it for hundreds of rounds, one probe row replacing one of them every
        64 AR rounds: on the default pair at batch 1 (H100 prices replayed on the CPU, session 45)
        a hard request's zeros kept the estimate at ~0.55 accepted drafts through the next
        requests, whose probes accepted 5, 7, 3 and 7. The estimate is dropped when anything
        left (the next ``curve`` reads the history's prior and the rounds after the streak)."""
        self._retire(int(rounds))

    def forget(self, share: float) -> None:
        """A ``share`` of the batch's rows left it (finished requests): as large a share of the
        window's rounds, the oldest first, leaves for the history (a carry keeps the fractions),
        so the window speaks of the requests in the batch rather than of those before them. At
        batch 1 a finished request empties it and the next request starts from the history's
        prior (the workload's recent requests, ~100 rounds) and its own rows: the window of the
        request before it had held the next one in AR rounds that its own acceptance did not call
        for (CPU replay of the H100's prices in bf16, session 45: requests accepting 1.4-2.1
        drafts a round in fixed rounds ran 70-96 % AR rounds after two that accepted ~0.7).
        Under ``FORGET_NOW`` of the batch the curve is estimated again when it is next due (after
        a ``prepare``: in the next one, off the round's host path), not at once: at batches 8-64 a
        request finishes every round or two, and estimating on the decision path each time cost
        the scheduled mode's fixed rounds 0.06-0.14 ms (H100, 930bd39: 0.69 / 0.97 / 1.21 ms
        against fixed mode's 0.63 / 0.84 / 1.07 at 8 / 32 / 64)."""
        share = max(0.0, min(1.0, float(share)))
        self._forget_carry += share * len(self.rounds)
        n = int(self._forget_carry)
        self._forget_carry -= n
        self._retire(n, now=share >= self.FORGET_NOW)

    def _retire(self, n: int, now: bool = True) -> None:
        """The window's ``n`` oldest rounds (at most all) leave it for the history; a deferred
        ``add``, the newest round, stays deferred. ``now``: drop the curve (the next read
        estimates it); else mark it due, as a round's ``add`` does."""
        n = min(n, len(self.rounds))
        for _ in range(n):
            self._retire_oldest()
        if n > 0 and now:
            self._drop()
        elif n > 0:
            self._due = True

    def _drop(self) -> None:
        self._curve, self._upper, self._due = None, None, False
        self._version += 1

    def prepare(self) -> None:
        """Estimate the curve now, while a round runs on the device (``Scheduler``: host work
        between a round's launch and its read-back), where a refresh is due; the round's ``add``
        then keeps it, so the next round's decisions read it at no host cost on their path: an
        estimate one round older (the decisions stay a function of the batch's history). A deferred
        ``add`` is applied first."""
        self.flush()
        if self._due:
            self._drop()
        self.curve()
        self._held = True

    def prior(self) -> np.ndarray:
        """[N] the prior conditional acceptance: ``(hist_survived_k + PRIOR_WEIGHT p_k) /
        (hist_at_risk_k + PRIOR_WEIGHT)`` of the rounds past the window (``HISTORY_DECAY``; none
        until the window is full) around ``p_k``, the ratio ``S_k / S_{k-1}`` of the head's mean
        calibrated prefix products ``S``, else of the ``measured`` curve, else ``PRIOR``; where
        ``S_{k-1}`` vanishes (or the measured curve ends), the previous position's."""
        p = self._external_prior()
        if not self._hist_risk.any():
            return p
        den = self._hist_risk + self.PRIOR_WEIGHT
        return np.divide(self._hist_surv + self.PRIOR_WEIGHT * p, den, out=p.copy(), where=den > 0)

    def _external_prior(self) -> np.ndarray:
        self.flush()
        if self.confidence:
            s = self._conf / self._conf_rows                                        # [N] S_k
        elif self.measured is not None:
            s = np.full(self.n, np.nan)
            s[: len(self.measured)] = self.measured[: self.n]
        else:
            return np.full(self.n, self.PRIOR)
        prev = np.concatenate([[1.0], s[:-1]])
        ratio = np.divide(s, prev, out=np.full(self.n, np.nan), where=prev > 1e-12)
        if not np.isfinite(ratio).all():
            for k in range(self.n):              # S_{k-1} ~ 0: carry the last defined hazard
                if not np.isfinite(ratio[k]):
                    ratio[k] = ratio[k - 1] if k else self.PRIOR
        return np.clip(ratio, 0.0, 1.0)

    def curve(self) -> np.ndarray:
        """[N] float64 prefix-survival estimate (cached until the next ``add``; with a full window
        for ``refresh`` rounds; after ``prepare`` until the round after next). A deferred ``add``
        waits where it would keep the curve (after ``prepare``), else is applied first."""
        if self._pending is not None and not self._held:
            self.flush()
        if self._curve is None:
            self._curve, self._upper, self._stale = self._estimate(), None, 0
        return self._curve

    def optimistic(self) -> np.ndarray:
        """[N] the curve (``curve``) scaled up so that its expected accepted drafts per row, ``mu =
        sum_k s_k``, sit at their one-sided 95 % upper bound ``mu + UPPER_Z sqrt(var / n)`` (each
        entry at most 1): ``var = sum_k (2k + 1) s_k - mu^2`` the variance of a row's accepted
        count under the curve, ``n`` the rows behind ``s_0`` (``at_risk_0 + PRIOR_WEIGHT``). What
        the AR fallback decides from (``Scheduler._falls_back_to_ar``): a window of batch-1 rounds
        is a few dozen rows, whose estimate dips on a few hard requests, and each dip would start
        an AR streak that its dear probes keep for hundreds of rounds (H100, default pair, batch 1:
        205 AR rounds to 123 speculative where fixed rounds beat AR by 1.19x); thousands of rows
        (batch 64) move it by a few percent. Before any verified row the prior alone, as the
        ``PRIOR_WEIGHT`` rows it weighs in the curve: the calibration's held-out survival was
        measured at its own temperature and prompts (the default pair's at temperature 1: 0.74
        accepted drafts a round, where greedy requests accepted 1.24 on an H100 in session 43),
        and taken as exact it started batch 1 in an AR streak that its probes rarely ended (765
        AR rounds to 45 speculative; scheduled / fixed N 0.76-0.88)."""
        curve = self.curve()
        if self._upper is None:
            mu, k = float(curve.sum()), np.arange(self.n)
            rows = self._risk[0] + self.PRIOR_WEIGHT
            if mu <= 0.0 or rows <= 0:
                self._upper = curve
            else:
                var = max(float(((2 * k + 1) * curve).sum()) - mu * mu, 0.0)
                se = np.sqrt(var / rows)
                self._upper = np.minimum(curve * (1.0 + self.UPPER_Z * se / mu), 1.0)
        return self._upper

    def _estimate(self) -> np.ndarray:
        at_risk, survived = self._risk, self._surv
        prior, den = self.prior(), at_risk + self.PRIOR_WEIGHT
        h = np.where(den > 0, (survived + self.PRIOR_WEIGHT * prior) / np.maximum(den, 1e-12),
                     prior)                         # nothing seen at k (no prior weight): the prior
        return np.cumprod(h)
