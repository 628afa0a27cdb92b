"""A bank's embedding classifier: logistic regression on the state's sentence embedding, trained on a bank.

    e         the state's unit-length all-MiniLM-L6-v2 embedding (``models.encoder``), 384 numbers
    q         multinomial logistic regression (C = 10) on e, over the question's n options

It is the encoder partner of a learned readout: one fitted with ``slotread fit --encoder`` adds
w_e · log q̃ to its scores (``quality.readouts.readout``), trained on the schema's example bank: an
encoder knows paraphrases that neither the model's read of a small shortlist nor word n-grams catch,
and with 5–10 examples per class it is the strongest single classifier here (RESULTS.md). Like the
lexical partner, q̃ = (1 − ε)·q + ε/n, its held-out q̃ are cross-fitted (fold f's classifier never
saw a fold-f item's text, ``lexical.cross_fitted``) and a served readout's classifier is fitted on
the whole served bank when the readouts load.

scikit-learn is imported inside the functions: the model side imports numpy, torch and transformers only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.lexical import cross_fitted
from slotread.quality.examples.meaning import Embed

#: The logistic regression's inverse L2 strength on unit-length embeddings.
INVERSE_L2 = 10.0


@dataclass(frozen=True, eq=False)
class EmbeddingClassifier:
    """A fitted logistic regression on embeddings over ``classes`` options; ``seen`` are the option indices
    its training labels held (the others get probability 0)."""

    model: Any
    seen: np.ndarray
    classes: int
    embed: Embed

    def probabilities(self, states: Sequence[str]) -> np.ndarray:
        """q (N, classes) for N states: each row sums to 1, options never seen in training get 0."""
        q = np.zeros((len(states), self.classes))
        q[:, self.seen] = self.model.predict_proba(self.embed(list(states)))
        return q


def fit_embedding_classifier(
    states: Sequence[str], labels: Sequence[int] | np.ndarray, classes: int, embed: Embed
) -> EmbeddingClassifier:
    """Fit the module docstring's classifier; deterministic. ValueError with fewer than two distinct labels."""
    from sklearn.linear_model import LogisticRegression

    labels = np.asarray(labels, dtype=np.int64)
    if len(np.unique(labels)) < 2:
        raise ValueError("an embedding classifier needs examples of at least two options")
    model = LogisticRegression(C=INVERSE_L2, max_iter=2000)
    model.fit(embed(list(states)), labels)
    return EmbeddingClassifier(model, np.asarray(model.classes_, dtype=np.int64), classes, embed)


def bank_embedding_classifier(bank: ExampleBank, embed: Embed) -> EmbeddingClassifier:
    """The classifier of a whole bank (what a served readout reads)."""
    return fit_embedding_classifier([e.state for e in bank.examples], bank.labels, len(bank.question.options), embed)


def cross_fitted_dense(
    bank: ExampleBank, states: Sequence[str], embed: Embed, folds: int, fitted: Callable[[], object] | None = None
) -> np.ndarray:
    """q̃ (N, n) of each of ``states`` from a classifier that never saw its text (``lexical.cross_fitted``)."""
    return cross_fitted(bank, states, folds, fitted, partial(fit_embedding_classifier, embed=embed))
