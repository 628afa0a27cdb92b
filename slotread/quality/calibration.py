"""Calibration maths: each method turns one read's label logits z (option order) into probabilities.

    none         p = softmax(z)
    temperature  p = softmax(z / T)                             T > 0 fitted by minimising the NLL
    contextual   p = softmax(z − log p_cf) ∝ softmax(z) / p_cf  p_cf: mean distribution of content-free reads
    batch        p = softmax(z − log m)    ∝ softmax(z) / m     m: running mean of earlier answers (store.py)

A read is calibrated under its own option→label assignment (p_cf and m are kept per shift), then
the answer is the mean over the reads, as without calibration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from slotread.core.aggregate import softmax
from slotread.core.questions import CalibrationMethod

#: The temperature is searched in [T_MIN, T_MAX]; an optimum beyond is clamped to the bound.
T_MIN, T_MAX = 0.05, 20.0
#: Golden-section search stops when the bracket on log T is this narrow.
_LOG_T_TOLERANCE = 1e-7
_INVERSE_PHI = (math.sqrt(5) - 1) / 2


def temperature_scale(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(z / T) over the last axis."""
    return softmax(np.asarray(logits, dtype=np.float64) / temperature)


def divide_prior(logits: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """softmax(z − log prior) = softmax(z) / prior, renormalised (contextual and batch calibration).

    The division is done on logits so that a prior or probability below float64's range stays exact.
    """
    return softmax(np.asarray(logits, dtype=np.float64) - np.log(np.maximum(prior, np.finfo(np.float64).tiny)))


def mean_nll(logits: np.ndarray, gold: np.ndarray, temperature: float = 1.0) -> float:
    """−(1/N) Σ_i log p_i(gold_i) with p_i = mean over item i's reads of softmax(z / T).

    ``logits`` is (N, n) with one read per item, or (N, R, n) with R reads each.
    """
    per_read = temperature_scale(_reads(logits), temperature)  # (N, R, n)
    p_gold = per_read[np.arange(len(gold)), :, gold].mean(axis=1)
    return float(-np.log(np.maximum(p_gold, np.finfo(np.float64).tiny)).mean())


def fit_temperature(logits: np.ndarray, gold: np.ndarray) -> float:
    """The T in [T_MIN, T_MAX] minimising ``mean_nll`` on labelled reads, by golden-section search on log T.

    With one read per item the NLL is convex in 1/T, so the search finds the global optimum; with
    several reads per item (a mean of softmaxes) it finds a local one.
    """
    gold = np.asarray(gold)

    def cost(log_t: float) -> float:
        return mean_nll(logits, gold, math.exp(log_t))

    a, b = math.log(T_MIN), math.log(T_MAX)
    c, d = b - _INVERSE_PHI * (b - a), a + _INVERSE_PHI * (b - a)
    fc, fd = cost(c), cost(d)
    while b - a > _LOG_T_TOLERANCE:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _INVERSE_PHI * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + _INVERSE_PHI * (b - a)
            fd = cost(d)
    return math.exp((a + b) / 2)


def calibrate_reads(
    logits: np.ndarray,
    shifts: Sequence[int],
    method: CalibrationMethod,
    temperature: float | None = None,
    content_free: Mapping[int, np.ndarray] | None = None,
) -> np.ndarray:
    """The calibrated distribution of each read: ``logits`` (R, n) in option order, read under ``shifts``.

    ``temperature`` is needed for "temperature", ``content_free`` (shift → p_cf) for "contextual";
    "batch" depends on traffic and is applied by the store, not here.
    """
    if method == "none":
        return softmax(logits)
    if method == "temperature" and temperature is not None:
        return temperature_scale(logits, temperature)
    if method == "contextual" and content_free is not None:
        return divide_prior(logits, np.stack([content_free[s] for s in shifts]))
    raise ValueError(f"calibrate_reads cannot apply {method!r} with what it was given")


def _reads(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    return z[:, None, :] if z.ndim == 2 else z
