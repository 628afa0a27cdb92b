"""Evaluation metrics: pure functions of predicted probabilities and gold labels, in numpy.

Conventions: ``probabilities`` is an (N, K) array, one row per item in class order, each row summing
to 1; ``gold`` and ``predicted`` are (N,) arrays of class indices; the prediction is the row's argmax.
A metric that is undefined on its input (kappa with one level in sight, precision with nothing
predicted) is NaN, and written to JSON as null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Top-label confidence bins of the expected calibration error: 15 of equal width over [0, 1].
ECE_BINS = 15
#: Probabilities are clipped up to this before the log in the NLL, so a zero costs -ln(1e-12) = 27.6.
NLL_EPSILON = 1e-12


def accuracy(predicted: np.ndarray, gold: np.ndarray) -> float:
    """Share of items whose prediction is the gold class."""
    return float(np.mean(predicted == gold))


def macro_f1(predicted: np.ndarray, gold: np.ndarray) -> float:
    """Mean over classes of F1 = 2TP / (2TP + FP + FN).

    The mean runs over the classes that occur as gold or as prediction (a class that never occurs
    has no F1), so a predicted class with no gold items counts 0: scikit-learn's
    ``f1_score(average="macro", zero_division=0)``.
    """
    scores = []
    for k in np.union1d(predicted, gold):
        tp = np.sum((predicted == k) & (gold == k))
        fp = np.sum((predicted == k) & (gold != k))
        fn = np.sum((predicted != k) & (gold == k))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


@dataclass(frozen=True)
class ReliabilityBins:
    """Items grouped by top-label confidence into equal-width bins over [0, 1].

    Bin b holds confidences in (b/B, (b+1)/B] (bin 0 also holds 0). ``confidence`` and ``accuracy``
    are the bin means (NaN for an empty bin).
    """

    edges: np.ndarray  # (B + 1,)
    counts: np.ndarray  # (B,)
    confidence: np.ndarray  # (B,)
    accuracy: np.ndarray  # (B,)


def reliability_bins(probabilities: np.ndarray, gold: np.ndarray, bins: int = ECE_BINS) -> ReliabilityBins:
    """Bin the items by top-label confidence (the largest probability) and measure each bin."""
    confidence = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == gold
    index = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_confidence = np.bincount(index, weights=confidence, minlength=bins) / counts
        mean_accuracy = np.bincount(index, weights=correct, minlength=bins) / counts
    return ReliabilityBins(np.linspace(0.0, 1.0, bins + 1), counts, mean_confidence, mean_accuracy)


def expected_calibration_error(probabilities: np.ndarray, gold: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE = sum_b (n_b / N) |accuracy_b - confidence_b| over top-label confidence bins."""
    grouped = reliability_bins(probabilities, gold, bins)
    filled = grouped.counts > 0
    gaps = np.abs(grouped.accuracy[filled] - grouped.confidence[filled])
    return float(np.sum(grouped.counts[filled] * gaps) / grouped.counts.sum())


def brier(probabilities: np.ndarray, gold: np.ndarray) -> float:
    """Multi-class Brier score: mean over items of sum_k (p_k - [k = gold])^2 (0 best, 2 worst)."""
    onehot = np.eye(probabilities.shape[1])[gold]
    return float(np.mean(np.sum((probabilities - onehot) ** 2, axis=1)))


def nll(probabilities: np.ndarray, gold: np.ndarray, epsilon: float = NLL_EPSILON) -> float:
    """Negative log-likelihood of the gold class, natural log, mean over items; p clipped at ``epsilon``."""
    p_gold = probabilities[np.arange(gold.size), gold]
    return float(-np.mean(np.log(np.maximum(p_gold, epsilon))))


def quadratic_weighted_kappa(predicted: np.ndarray, gold: np.ndarray, levels: int) -> float:
    """Cohen's kappa with weights w_ij = (i - j)^2 / (L - 1)^2: 1 - sum(w O) / sum(w E).

    O is the confusion matrix (gold by predicted), E the outer product of its marginals over N.
    NaN when E puts all its mass on the diagonal (one level in sight on both sides).
    """
    observed = np.zeros((levels, levels))
    np.add.at(observed, (gold, predicted), 1)
    expected = np.outer(observed.sum(axis=1), observed.sum(axis=0)) / gold.size
    i, j = np.indices((levels, levels))
    weights = (i - j) ** 2 / (levels - 1) ** 2
    chance = np.sum(weights * expected)
    return float(1.0 - np.sum(weights * observed) / chance) if chance > 0 else math.nan


def precision_recall(predicted: np.ndarray, gold: np.ndarray, positive: int) -> tuple[float, float]:
    """Precision TP / (TP + FP) and recall TP / (TP + FN) of one class; NaN where nothing is counted."""
    tp = np.sum((predicted == positive) & (gold == positive))
    predicted_positive = np.sum(predicted == positive)
    gold_positive = np.sum(gold == positive)
    precision = tp / predicted_positive if predicted_positive else math.nan
    recall = tp / gold_positive if gold_positive else math.nan
    return float(precision), float(recall)


def within_one(predicted: np.ndarray, gold: np.ndarray) -> float:
    """Share of score items whose predicted level is at most one level from the gold level."""
    return float(np.mean(np.abs(predicted - gold) <= 1))


def coverage(sets: Sequence[tuple[int, ...]], gold: np.ndarray) -> float:
    """Empirical coverage of prediction sets: share of items whose gold class is in the item's set."""
    return float(np.mean([int(g) in members for members, g in zip(sets, gold, strict=True)]))


def mean_set_size(sets: Sequence[tuple[int, ...]]) -> float:
    """Mean number of classes in a prediction set (an empty set counts 0)."""
    return float(np.mean([len(members) for members in sets]))


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile, linear interpolation between order statistics (numpy's default)."""
    return float(np.percentile(values, q))


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    ``a_only`` items only system A got right, ``b_only`` only B. Under the null each discordant pair
    goes either way with probability 1/2: p = min(1, 2 * P(X <= min(a_only, b_only))), X ~ Bin(n, 1/2),
    n = a_only + b_only; 1 when there is no discordant pair.
    """
    n = a_only + b_only
    tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1))
    return min(1.0, 2 * tail / 2**n)


def summarise(
    probabilities: np.ndarray,
    gold: np.ndarray,
    *,
    ordinal: bool,
    positive: int | None,
    latency_ms: np.ndarray,
    reads: np.ndarray | None,
    sets: Sequence[tuple[int, ...] | None] | None = None,
) -> dict[str, float]:
    """Every metric of one run, keyed as in metrics.json.

    ``ordinal`` adds quadratic weighted kappa and within-one accuracy (scores); ``positive`` is the
    class whose precision and recall are reported (CLINC150's out-of-scope); ``reads`` is None when
    the predictor reads no model (the baseline); ``sets`` (an item's conformal set, None where it
    has none) adds coverage and mean set size over the items that have a set.
    """
    predicted = probabilities.argmax(axis=1)
    metrics = {
        "accuracy": accuracy(predicted, gold),
        "macro_f1": macro_f1(predicted, gold),
        "ece": expected_calibration_error(probabilities, gold),
        "brier": brier(probabilities, gold),
        "nll": nll(probabilities, gold),
    }
    if ordinal:
        metrics["qwk"] = quadratic_weighted_kappa(predicted, gold, probabilities.shape[1])
        metrics["within_one"] = within_one(predicted, gold)
    if positive is not None:
        metrics["oos_precision"], metrics["oos_recall"] = precision_recall(predicted, gold, positive)
    metrics["latency_p50_ms"] = percentile(latency_ms, 50)
    metrics["latency_p95_ms"] = percentile(latency_ms, 95)
    if reads is not None:
        metrics["reads_per_item"] = float(np.mean(reads))
    if sets is not None:
        with_set = [k for k, members in enumerate(sets) if members is not None]
        present = [members for members in sets if members is not None]
        if present:
            metrics["coverage"] = coverage(present, gold[with_set])
            metrics["mean_set_size"] = mean_set_size(present)
    return metrics
