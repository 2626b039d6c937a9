"""Sequential Temperature Scaling of the confidence head (paper §3.2.1) and its metrics.

Data: per verified round, the confidence logits ``l [N]``, how many drafts the round verified
(``n``: positions >= n carry no label) and how many it accepted (``a``). The prediction for position
k is the prefix-survival probability ``prod_{j<=k} sigmoid(l_j / T_j)`` and its label is
``a > k`` (the whole prefix 0..k was accepted), as DeepSpec's confidence recorder scores it.

STS fits T_0, T_1, ... left to right: for position k, a 1-D grid search over T_k minimises the
expected calibration error (ECE, equal-width bins) of position k's cumulative product, the
already-fitted T_{<k} held fixed. Temperature scaling is monotone, so ROC-AUC of each position's
prediction changes only through earlier positions (position 0's not at all).
"""
from __future__ import annotations

import math

import numpy as np

GRID = np.exp(np.linspace(math.log(0.05), math.log(20.0), 241))     # temperatures searched
NUM_BINS = 10


def ece(pred: np.ndarray, label: np.ndarray, bins: int = NUM_BINS) -> float:
    """Expected calibration error of probabilities ``pred`` against labels in [0, 1]."""
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    if pred.size == 0:
        return float("nan")
    b = np.clip((pred * bins).astype(np.int64), 0, bins - 1)
    sp = np.bincount(b, pred, minlength=bins)
    sl = np.bincount(b, label, minlength=bins)
    return float(np.abs(sp - sl).sum() / pred.size)


def roc_auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); nan without both classes."""
    score, label = np.asarray(score, np.float64), np.asarray(label) > 0.5
    npos, nneg = int(label.sum()), int((~label).sum())
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):                             # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i:j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = np.empty(len(s))
    r[order] = ranks
    return float((r[label].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def arrays(rounds: list[tuple[list[float], int, int]], N: int) -> tuple[np.ndarray, np.ndarray,
                                                                        np.ndarray]:
    """rounds [(logits [N], verified n, accepted a)] -> logits [R, N], valid [R, N] (k < n),
    labels [R, N] (a > k)."""
    logits = np.array([r[0][:N] for r in rounds], np.float64).reshape(-1, N)
    n = np.array([r[1] for r in rounds]).reshape(-1, 1)
    a = np.array([r[2] for r in rounds]).reshape(-1, 1)
    k = np.arange(N)[None]
    return logits, k < n, (a > k).astype(np.float64)


def survival(logits: np.ndarray, temperatures) -> np.ndarray:
    """Prefix-survival predictions [R, N] = cumprod(sigmoid(l_k / T_k))."""
    N = logits.shape[1]
    t = np.array([temperatures[min(k, len(temperatures) - 1)] for k in range(N)], np.float64)
    return np.cumprod(_sigmoid(logits / t[None]), 1)


def fit_sts(logits: np.ndarray, valid: np.ndarray, labels: np.ndarray,
            grid: np.ndarray = GRID) -> list[float]:
    """Per-position temperatures minimising each position's cumulative-product ECE, left to right
    (a position without data keeps T = 1)."""
    R, N = logits.shape
    temps: list[float] = []
    prefix = np.ones(R)
    for k in range(N):
        m = valid[:, k]
        best_t = 1.0
        if m.any():
            errs = [ece(prefix[m] * _sigmoid(logits[m, k] / t), labels[m, k]) for t in grid]
            best_t = float(grid[int(np.argmin(errs))])
        temps.append(best_t)
        prefix = prefix * _sigmoid(logits[:, k] / best_t)
    return temps


def metrics(logits: np.ndarray, valid: np.ndarray, labels: np.ndarray, temperatures) -> dict:
    """ECE and ROC-AUC per position and summarised (weighted by each position's count)."""
    pred = survival(logits, temperatures)
    per = []
    for k in range(logits.shape[1]):
        m = valid[:, k]
        per.append({"position": k, "count": int(m.sum()), "ece": ece(pred[m, k], labels[m, k]),
                    "auc": roc_auc(pred[m, k], labels[m, k]),
                    "pred_mean": float(pred[m, k].mean()) if m.any() else float("nan"),
                    "label_mean": float(labels[m, k].mean()) if m.any() else float("nan")})
    w = np.array([p["count"] for p in per], np.float64)

    def mean(key):
        v = np.array([p[key] for p in per])
        ok = (w > 0) & np.isfinite(v)
        return float((v[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else float("nan")

    m = valid.reshape(-1)
    return {"ece": mean("ece"), "auc": mean("auc"),
            "ece_pooled": ece(pred.reshape(-1)[m], labels.reshape(-1)[m]),
            "auc_pooled": roc_auc(pred.reshape(-1)[m], labels.reshape(-1)[m]),
            "per_position": per}
