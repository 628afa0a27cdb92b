"""Split-conformal prediction sets.

nonconformity   s_i = 1 − p_i(gold_i) on n labelled calibration items
threshold       q̂ = the ⌈(n + 1)·c⌉-th smallest s_i for target coverage c (∞ when that rank exceeds n)
set             { options j : 1 − p_j ≤ q̂ }   (may be empty; every option when q̂ = ∞)

If the calibration items and a new item are exchangeable, the set holds the new item's true answer
with probability at least c (and below c + 1/(n + 1) when the scores have no ties).
"""

from __future__ import annotations

import math

import numpy as np

#: ⌈(n + 1)·c⌉ is taken after subtracting this, so that float noise (10 × 0.7 = 7.000000000000001)
#: does not move the rank up by one.
_RANK_SLACK = 1e-9


def nonconformity(probabilities: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """1 − p(gold) per item: ``probabilities`` (N, n), ``gold`` (N,) option indices."""
    return 1.0 - probabilities[np.arange(len(gold)), gold]


def conformal_threshold(scores: np.ndarray, coverage: float) -> float:
    """q̂: the ⌈(n + 1)·coverage⌉-th smallest score, or ∞ when that rank exceeds n."""
    n = len(scores)
    rank = math.ceil((n + 1) * coverage - _RANK_SLACK)
    return float(np.sort(scores)[rank - 1]) if rank <= n else math.inf


def prediction_set(probabilities: np.ndarray, threshold: float) -> tuple[int, ...]:
    """The options whose nonconformity 1 − p is at most the threshold, in option order."""
    return tuple(int(j) for j in np.flatnonzero(1.0 - probabilities <= threshold))
