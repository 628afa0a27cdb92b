"""The lexical classifier: TF-IDF + logistic regression on a bank's texts, cross-fitted for held-out items."""

import numpy as np
import pytest

from slotread.core.questions import Option, Question
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.lexical import FLOOR, bank_classifier, cross_fitted, fit_text_classifier, floored

QUESTION = Question("q", "choice", "Which?", (Option("refund"), Option("card"), Option("pin")))
PAIRS = [
    ("i want my money back", "refund"),
    ("please refund this payment", "refund"),
    ("refund the purchase please", "refund"),
    ("give me a refund", "refund"),
    ("where is my new card", "card"),
    ("my card has not arrived", "card"),
    ("card still not delivered", "card"),
    ("zebra quartz xylophone", "card"),  # a text like no other: only memorising it says "card"
    ("zebra quartz xylophone", "card"),  # and its exact repeat
]
BANK = ExampleBank.from_pairs(QUESTION, None, PAIRS, "bank")  # no example says "pin"


def test_options_no_example_holds_get_zero_and_the_floor_keeps_logs_finite() -> None:
    q = bank_classifier(BANK).probabilities(["refund my payment", "my card"])
    assert q.shape == (2, 3) and q.sum(axis=1) == pytest.approx([1.0, 1.0])
    assert list(q.argmax(axis=1)) == [0, 1] and np.all(q[:, 2] == 0.0)
    smoothed = floored(q)
    assert smoothed.sum(axis=1) == pytest.approx([1.0, 1.0]) and np.all(smoothed[:, 2] == pytest.approx(FLOOR / 3))
    with pytest.raises(ValueError, match="at least two options"):
        fit_text_classifier(["a", "b"], [1, 1], 3)


def test_a_cross_fitted_item_is_answered_by_a_classifier_that_never_saw_its_text() -> None:
    memorised = bank_classifier(BANK).probabilities(["zebra quartz xylophone"])[0]
    assert memorised[1] > 0.9  # trained on it, the classifier recalls its label

    held = ["zebra quartz xylophone", "give me a refund", "where is my new card"]
    found = cross_fitted(BANK, held, folds=2)  # fold 0: held[0] and held[2]; fold 1: held[1]
    assert found[0][1] < 0.3  # its neighbours in the text say "refund" more than "card"
    # exactly the classifier of the bank without fold 0's texts, both copies of the repeat included
    kept = [i for i, (text, _) in enumerate(PAIRS) if text not in (held[0], held[2])]
    unseen = fit_text_classifier([PAIRS[i][0] for i in kept], BANK.labels[kept], 3)
    assert found[[0, 2]] == pytest.approx(floored(unseen.probabilities([held[0], held[2]])), abs=1e-12)
    alone = [i for i, (text, _) in enumerate(PAIRS) if text != held[1]]
    without = fit_text_classifier([PAIRS[i][0] for i in alone], BANK.labels[alone], 3)
    assert found[1] == pytest.approx(floored(without.probabilities([held[1]]))[0], abs=1e-12)
    calls: list[int] = []
    cross_fitted(BANK, held[:1], folds=5, fitted=lambda: calls.append(1))
    assert calls == [1]  # never more folds than items
