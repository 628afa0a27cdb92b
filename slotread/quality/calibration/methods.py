"""Calibration maths: each method turns one read's label logits z (option order) into probabilities.

    none         p = softmax(z)
    temperature  p = softmax(z / T)                             T > 0 fitted by minimising the NLL
    contextual   p = softmax(z − log p_cf) ∝ softmax(z) / p_cf  p_cf: mean distribution of content-free reads
    batch        p = softmax(z − log m)    ∝ softmax(z) / m     m: running mean of earlier answers (store.py)

A read is calibrated under its own option→label assignment (p_cf and m are kept per shift), then
the answer is the mean over the reads, as without calibration.

    binned       the contextual answer p (mean over reads), then its top option's probability set by
                 top-label histogram binning (Gupta & Ramdas 2021), the others rescaled

Binning is fitted on N labelled answers: c_i = max p_i (top-label confidence), y_i = [argmax p_i = gold_i].
B = min(bins, max(1, ⌊N / min_per_bin⌋)) equal-mass bins: the upper edge of bin b < B is the
⌈bN/B⌉-th smallest c (repeated edges merged, an edge equal to max c dropped), so bin b holds
c in (e_{b−1}, e_b] and the last holds c > e_{B−1}. A bin's value is its smoothed accuracy
(Σy + 1)/(n + 2), then made non-decreasing by pooling adjacent violators (means weighted by n).
Applied to p with top j, c = p_j, runner-up s, bin value v: t = max(v, min(c, (1 + 1e-9)·s / (1 − c + s))),
p'_j = t, p'_k = p_k·(1 − t)/(1 − c). s / (1 − c + s) ≤ c is where the rescaled runner-up would tie
the top, so the argmax never changes (an answer with c = 1, or whose argmax rounding would still move,
is left as it is).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from slotread.core.aggregate import softmax
from slotread.core.questions import CalibrationMethod

#: The temperature is searched in [T_MIN, T_MAX]; an optimum beyond is clamped to the bound.
T_MIN, T_MAX = 0.05, 20.0
#: Golden-section search stops when the bracket on log T is this narrow.
_LOG_T_TOLERANCE = 1e-7
_INVERSE_PHI = (math.sqrt(5) - 1) / 2
#: Top-label bins: at most BINS, and at least MIN_PER_BIN calibration answers in each (on average).
BINS, MIN_PER_BIN = 10, 30
#: The binned top value stays this far (relatively) above where the runner-up would tie it.
_TIE_MARGIN = 1e-9


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


def fit_temperature(logits: np.ndarray, gold: np.ndarray, offset: np.ndarray | float = 0.0) -> float:
    """The T in [T_MIN, T_MAX] minimising ``mean_nll`` of z / T + ``offset`` on labelled reads, by
    golden-section search on log T (``offset``, e.g. a learned readout's vote term, is not scaled).

    With one read per item the NLL is convex in 1/T, so the search finds the global optimum; with
    several reads per item (a mean of softmaxes) it finds a local one.
    """
    gold = np.asarray(gold)
    logits = np.asarray(logits, dtype=np.float64)

    def cost(log_t: float) -> float:
        return mean_nll(logits / math.exp(log_t) + offset, gold)

    return math.exp(golden_section(cost, math.log(T_MIN), math.log(T_MAX), _LOG_T_TOLERANCE))


def golden_section(cost: Callable[[float], float], low: float, high: float, tolerance: float) -> float:
    """The x in [low, high] minimising ``cost`` (unimodal there), to within ``tolerance``."""
    a, b = low, high
    c, d = b - _INVERSE_PHI * (b - a), a + _INVERSE_PHI * (b - a)
    fc, fd = cost(c), cost(d)
    while b - a > tolerance:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _INVERSE_PHI * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + _INVERSE_PHI * (b - a)
            fd = cost(d)
    return (a + b) / 2


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


@dataclass(frozen=True, eq=False)
class TopLabelBins:
    """Fitted top-label bins: ``edges`` (B − 1,) ascending upper edges, ``values`` (B,) non-decreasing
    calibrated confidences, ``counts`` (B,) calibration answers per bin."""

    edges: np.ndarray
    values: np.ndarray
    counts: np.ndarray

    def bin_of(self, confidence: np.ndarray) -> np.ndarray:
        """The bin of each top-label confidence: the number of edges below it."""
        return np.searchsorted(self.edges, confidence, side="left")


def fit_top_label_bins(
    probabilities: np.ndarray, gold: np.ndarray, bins: int = BINS, min_per_bin: int = MIN_PER_BIN
) -> TopLabelBins:
    """Equal-mass top-label bins over answers ``probabilities`` (N, n) with gold option indices (N,)."""
    confidence = probabilities.max(axis=1)
    correct = (probabilities.argmax(axis=1) == np.asarray(gold)).astype(np.float64)
    n = len(confidence)
    count = min(bins, max(1, n // min_per_bin))
    ordered = np.sort(confidence)
    edges = np.unique(ordered[[math.ceil(b * n / count) - 1 for b in range(1, count)]])
    edges = edges[edges < ordered[-1]]
    fitted = TopLabelBins(edges, np.zeros(len(edges) + 1), np.zeros(len(edges) + 1))
    index = fitted.bin_of(confidence)
    counts = np.bincount(index, minlength=len(edges) + 1).astype(np.float64)
    hits = np.bincount(index, weights=correct, minlength=len(edges) + 1)
    return TopLabelBins(edges, pool_adjacent_violators((hits + 1) / (counts + 2), counts), counts)


def pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (weights > 0)."""
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for value, weight in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v1, w1, k1), (v2, w2, k2) = blocks.pop(-2), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
    return np.array([v for v, _, k in blocks for _ in range(int(k))])


def apply_top_label_bins(probabilities: np.ndarray, fitted: TopLabelBins) -> np.ndarray:
    """Each answer (row of ``probabilities``, (n,) or (N, n)) with its top probability set to its bin's
    value, the argmax kept (see the module docstring)."""
    p = np.atleast_2d(np.asarray(probabilities, dtype=np.float64))
    rows = np.arange(len(p))
    top = p.argmax(axis=1)
    c = p[rows, top]
    s = np.partition(p, -2, axis=1)[:, -2] if p.shape[1] > 1 else np.zeros(len(p))
    with np.errstate(invalid="ignore", divide="ignore"):
        tie = s / (1 - c + s)
        t = np.maximum(fitted.values[fitted.bin_of(c)], np.minimum(c, (1 + _TIE_MARGIN) * tie))
        out = p * ((1 - t) / (1 - c))[:, None]
    out[rows, top] = t
    keep = (c >= 1) | (out.argmax(axis=1) != top)
    out[keep] = p[keep]
    return out.reshape(np.shape(probabilities))


def _reads(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    return z[:, None, :] if z.ndim == 2 else z
