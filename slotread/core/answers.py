"""Typed answers and the Jev formulas for score and confidence.

choice confidence  c = (m - 1/n) / (1 - 1/n)          m the top probability, n options
score              s = sum_i i * p_i                  0-indexed, may fall between levels
score confidence   c = max(0, 1 - sum_i p_i |i - k| / D),  k = argmax,
                   D = (1/n) * sum_i |i - (n-1)/2|    (mean distance to the middle)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slotread.core.aggregate import ReadSummary
from slotread.core.questions import Question


def choice_confidence(probabilities: np.ndarray) -> float:
    """(m - 1/n) / (1 - 1/n): 0 when uniform, 1 when certain."""
    n = probabilities.size
    return float((probabilities.max() - 1.0 / n) / (1.0 - 1.0 / n))


def score_expectation(probabilities: np.ndarray) -> float:
    """sum_i i * p_i over levels 0..n-1."""
    return float(np.dot(np.arange(probabilities.size), probabilities))


def score_confidence(probabilities: np.ndarray) -> float:
    """max(0, 1 - sum_i p_i |i - k| / D) with k the top level and D the mean distance to the middle."""
    n = probabilities.size
    levels = np.arange(n)
    top = int(probabilities.argmax())
    spread = float(np.abs(levels - (n - 1) / 2).mean())
    return max(0.0, 1.0 - float(np.dot(probabilities, np.abs(levels - top))) / spread)


@dataclass(frozen=True)
class Read:
    """One read of a question's slot: its label logits in option order (whatever labels the options
    were listed under), the assignment's cyclic ``shift`` (``core.assignments``), the vocabulary
    probability that fell on the labels at all, and, for a decision read for a learned readout, the
    slot's final hidden state (None otherwise, or from an engine that returns none)."""

    shift: int
    logits: np.ndarray
    label_mass: float
    hidden: np.ndarray | None = None


@dataclass(frozen=True)
class Answer:
    """The answer to one question: the label distribution in option order, its diagnostics, and the
    raw reads it was built from.

    ``stderr``/``agreement`` exist only when the question was read more than once.
    ``prediction_set`` holds the option indices of a conformal prediction set, when one was asked for.
    ``thought`` is the text the model thought before its reads (``core.thinking``), when it thought.
    """

    question: Question
    summary: ReadSummary
    reads: tuple[Read, ...]
    prediction_set: tuple[int, ...] | None = None
    thought: str | None = None

    @property
    def probabilities(self) -> np.ndarray:
        """P(option) in option order."""
        return self.summary.probabilities

    @property
    def label_mass(self) -> float:
        """The vocabulary probability that fell on the labels, mean over the reads."""
        return float(np.mean([read.label_mass for read in self.reads]))

    @property
    def top(self) -> int:
        """Index of the most probable option."""
        return int(self.probabilities.argmax())

    @property
    def top_name(self) -> str:
        """Name of the most probable option (``yes``/``no`` for a noul, the level index for a score)."""
        return self.question.options[self.top].name


@dataclass(frozen=True)
class DecisionResult:
    """Answers keyed by question id in request order (None: not asked), and what the reads cost.

    ``input_tokens`` counts prompt and canvas tokens once per read unit; ``output_tokens`` counts the
    slots read, once per draw.
    """

    answers: dict[str, Answer | None]
    input_tokens: int
    output_tokens: int
