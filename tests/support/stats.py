"""Goodness of fit for the distribution tests (chi-square, sparse cells pooled)."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

ALPHA = 1e-3              # significance level of every distribution test


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs.ravel() * counts.sum()
    obs = counts.ravel().astype(float)
    small = exp < 5
    if small.any():           # pool the sparse cells into one
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    exp *= obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)
