"""From label logits to probabilities: softmax, the mean over noise draws, and its spread.

Pure functions from numbers to numbers; all arithmetic in float64 so that probabilities sum to 1
to full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis: exp(x - max) / sum exp(x - max), in float64."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def normalised_entropy(probabilities: np.ndarray) -> float:
    """Entropy of the label distribution divided by log(n): 0 for a sure answer, 1 for uniform."""
    p = np.asarray(probabilities, dtype=np.float64)
    nonzero = p[p > 0]
    return float(-(nonzero * np.log(nonzero)).sum() / np.log(p.size))


@dataclass(frozen=True)
class DrawSummary:
    """The answer distribution of one slot over K draws.

    ``probabilities`` is the mean of the per-draw label softmaxes; ``stderr`` its standard error per
    option (sample std with ddof=1 over sqrt(K); None when K = 1); ``agreement`` the share of draws
    whose top label is the top label of the mean (None when K = 1); ``entropy`` the normalised
    entropy of the mean.
    """

    probabilities: np.ndarray
    stderr: np.ndarray | None
    agreement: float | None
    entropy: float
    draws: int


def aggregate_draws(draw_logits: list[np.ndarray]) -> DrawSummary:
    """Summarise one slot's label logits over its draws (each array holds one draw's n logits)."""
    per_draw = softmax(np.stack(draw_logits))  # (K, n)
    mean = per_draw.mean(axis=0)
    mean = mean / mean.sum()
    draws = per_draw.shape[0]
    if draws == 1:
        return DrawSummary(mean, None, None, normalised_entropy(mean), 1)
    stderr = per_draw.std(axis=0, ddof=1) / np.sqrt(draws)
    agreement = float((per_draw.argmax(axis=1) == mean.argmax()).mean())
    return DrawSummary(mean, stderr, agreement, normalised_entropy(mean), draws)
