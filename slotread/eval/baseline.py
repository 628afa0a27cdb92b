"""Reference points with no language model, trained on the dataset's train split.

``tfidf``: TF-IDF features and logistic regression. ``knn``: the smoothed label vote of the K
nearest examples of an example bank, by its retrieval (BM25, dense or hybrid,
``quality.examples.retrieval``; ``quality.examples.bank.vote_distribution``: one vote per
neighbour, a pseudo count of one vote spread over the options), the vote a model read with
``x_examples``/``x_shortlist`` must beat to show that reading the model adds anything (issue 6).
Each answers the same items and writes the same run folder as a model run, so it sits in the same
tables. The state text is all it sees (no question), so it needs a train split with the same classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slotread.errors import EvalError
from slotread.eval.banks import bank_info, check_bank, without_evaluated
from slotread.eval.datasets import Dataset, Item
from slotread.eval.predictions import Prediction
from slotread.eval.runner import Predictor, run, run_info
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.lexical import fit_text_classifier
from slotread.quality.examples.retrieval import Retrieval

SYSTEM = "tfidf-logreg"


def tfidf_predictor(train: Dataset) -> Predictor:
    """Fit TF-IDF + logistic regression (``quality.examples.lexical.fit_text_classifier``) on ``train``.

    Classes absent from the train split get probability 0.
    """
    classifier = fit_text_classifier(
        [item.state for item in train.items], [item.gold for item in train.items], len(train.task.classes)
    )

    def predict(item: Item) -> Prediction:
        return Prediction(classifier.probabilities([item.state])[0])

    return predict


def evaluate_baseline(dataset: Dataset, train: Dataset, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Train on ``train`` less the texts ``dataset`` holds (``banks.without_evaluated``), then run ``dataset``
    into ``out`` like a model run."""
    if train.task.classes != dataset.task.classes:
        raise EvalError(f"the train data ({train.name} {train.split}) has other classes than the evaluated data")
    train, dropped = without_evaluated(train, dataset)
    if len({item.gold for item in train.items}) < 2:
        raise EvalError(f"the train data ({train.name} {train.split}) needs at least two classes")
    info = run_info(dataset, SYSTEM, None) | {"train": [train.name, train.split]}
    if dropped:
        info["train_dropped_overlap"] = dropped
    return run(dataset, out, info, lambda: tfidf_predictor(train), progress=progress)


def knn_system(k: int, retrieval: Retrieval = "bm25") -> str:
    """The neighbour vote's name in run folders and tables."""
    return f"{retrieval}-vote-{k}"


def knn_predictor(bank: ExampleBank, k: int) -> Predictor:
    """Answer an item with the smoothed label vote of its k nearest bank examples (by the bank's retrieval)."""

    def predict(item: Item) -> Prediction:
        return Prediction(bank.vote(item.state, k))

    return predict


def evaluate_knn(dataset: Dataset, bank: ExampleBank, k: int, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Run the k-neighbour vote of ``bank`` on ``dataset`` into ``out`` like a model run.

    EvalError if the bank serves another question or holds an evaluated item's text.
    """
    if k < 1:
        raise EvalError("the neighbour vote needs --examples K of at least 1")
    check_bank(bank, dataset)
    if bank.embed is not None:  # embed the evaluated texts in batches now: the encoder caches them for the votes
        bank.embed([item.state for item in dataset.items])
    info = run_info(dataset, knn_system(k, bank.retrieval), None) | {"example_bank": bank_info(bank), "neighbours": k}
    return run(dataset, out, info, lambda: knn_predictor(bank, k), progress=progress)
