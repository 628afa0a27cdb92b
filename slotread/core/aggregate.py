"""From label logits to probabilities: softmax, the mean over a question's reads, and its spread.

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
class ReadSummary:
    """The answer distribution of one question over its R reads (noise draws × option assignments).

    ``probabilities`` is the mean of the per-read label distributions (in option order); ``stderr``
    its standard error per option (sample std with ddof=1 over sqrt(R), the reads taken as one
    sample; None when R = 1); ``agreement`` the share of reads whose top option is the top option of
    the mean (None when R = 1); ``entropy`` the normalised entropy of the mean.
    """

    probabilities: np.ndarray
    stderr: np.ndarray | None
    agreement: float | None
    entropy: float
    reads: int


def aggregate_reads(per_read: np.ndarray) -> ReadSummary:
    """Summarise one question's reads: ``per_read`` is (R, n), one label distribution per read."""
    mean = per_read.mean(axis=0)
    mean = mean / mean.sum()
    reads = per_read.shape[0]
    if reads == 1:
        return ReadSummary(mean, None, None, normalised_entropy(mean), 1)
    stderr = per_read.std(axis=0, ddof=1) / np.sqrt(reads)
    agreement = float((per_read.argmax(axis=1) == mean.argmax()).mean())
    return ReadSummary(mean, stderr, agreement, normalised_entropy(mean), reads)
