"""A bank's text classifier: TF-IDF + logistic regression over the state's text, trained on a bank.

    features  TF-IDF of word 1-2-grams and of character 2-5-grams (within word boundaries), sublinear tf
    q         multinomial logistic regression (C = 10) on them, over the question's n options

It is the ``slotread eval --baseline tfidf`` reference point (``eval.baseline`` builds it here) and
the lexical partner of a learned readout: one fitted with ``slotread fit --lexical`` adds w_l · log q̃
to its scores (``quality.readouts.readout``), trained on the schema's example bank: the text
classifier and the model err on different items.
q̃ = (1 − ε)·q + ε/n keeps log q̃ finite, options no bank example is labelled with included (q = 0).

The readout's weights are fitted on held-out items that the bank holds, so their q̃ is cross-fitted
(``cross_fitted``): the items are dealt into K folds, and fold f's classifier is trained on every bank
example whose text is not the text of an item of fold f, so no item is answered by a classifier that
saw it (or an exact repeat of it), as the vote leaves the item's own text out. A served readout's
classifier is fitted on the whole served bank, deterministically, when the readouts are loaded
(``ReadoutStore``): a character n-gram model is far larger than the readout's artifact.

scikit-learn is imported inside the functions: the model side imports numpy, torch and transformers
only (``tests/test_layering.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slotread.quality.examples.bank import ExampleBank

#: The logistic regression's inverse L2 strength. Chosen on 2,000 BANKING77 train messages held out
#: from the rest: word n-grams alone 87.2% (C=10) and 87.5% (C=100), with character n-grams 89.4% (C=10).
INVERSE_L2 = 10.0
#: q̃ = (1 − ε)·q + ε/n: the share of uniform mass mixed in, so that log q̃ is finite.
FLOOR = 1e-3
#: Folds the held-out items are dealt into for cross-fitting.
FOLDS = 5


@dataclass(frozen=True, eq=False)
class TextClassifier:
    """A fitted TF-IDF + logistic regression pipeline over ``classes`` options; ``seen`` are the option
    indices its training labels held (the others get probability 0)."""

    pipeline: Any
    seen: np.ndarray
    classes: int

    def probabilities(self, states: Sequence[str]) -> np.ndarray:
        """q (N, classes) for N states: each row sums to 1, options never seen in training get 0."""
        q = np.zeros((len(states), self.classes))
        q[:, self.seen] = self.pipeline.predict_proba(list(states))
        return q


def fit_text_classifier(states: Sequence[str], labels: Sequence[int] | np.ndarray, classes: int) -> TextClassifier:
    """Fit the module docstring's classifier on ``states`` with option indices ``labels`` in [0, classes).

    Deterministic: the same pairs in the same order give the same classifier. ValueError with fewer
    than two distinct labels.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline, make_union

    labels = np.asarray(labels, dtype=np.int64)
    if len(np.unique(labels)) < 2:
        raise ValueError("a text classifier needs examples of at least two options")
    features = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True),
    )
    pipeline = make_pipeline(features, LogisticRegression(C=INVERSE_L2, max_iter=1000))
    pipeline.fit(list(states), labels)
    return TextClassifier(pipeline, np.asarray(pipeline.classes_, dtype=np.int64), classes)


def floored(q: np.ndarray) -> np.ndarray:
    """q̃ = (1 − FLOOR)·q + FLOOR/n over the last axis: positive everywhere, still summing to 1."""
    return (1 - FLOOR) * q + FLOOR / q.shape[-1]


def bank_classifier(bank: ExampleBank) -> TextClassifier:
    """The classifier of a whole bank (what a served readout reads)."""
    return fit_text_classifier([e.state for e in bank.examples], bank.labels, len(bank.question.options))


class Classifier(Protocol):
    """What cross-fitting trains: anything that gives class probabilities (N, n) of states."""

    def probabilities(self, states: Sequence[str]) -> np.ndarray: ...


def cross_fitted(
    bank: ExampleBank,
    states: Sequence[str],
    folds: int = FOLDS,
    fitted: Callable[[], object] | None = None,
    fit: Callable[[Sequence[str], np.ndarray, int], Classifier] = fit_text_classifier,
) -> np.ndarray:
    """q̃ (N, n) of each of ``states`` from a classifier that never saw its text (module docstring).

    State i goes to fold i mod K (K = min(folds, N)); fold f's classifier (``fit``: this module's, or
    another partner's such as ``quality.examples.dense``) is trained on the bank examples whose text is no fold-f
    state's text; ``fitted`` is called after each fold (a progress bar). ValueError when such a training
    part is left with one option.
    """
    folds = max(1, min(folds, len(states)))
    found = np.zeros((len(states), len(bank.question.options)))
    for fold in range(folds):
        members = list(range(fold, len(states), folds))
        unseen = {states[i] for i in members}
        kept = [i for i, example in enumerate(bank.examples) if example.state not in unseen]
        classifier = fit([bank.examples[i].state for i in kept], bank.labels[kept], found.shape[1])
        found[members] = classifier.probabilities([states[i] for i in members])
        if fitted is not None:
            fitted()
    return floored(found)
