"""The TF-IDF + logistic regression baseline on a small train split written here."""

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from slotread.errors import EvalError
from slotread.eval.banks import bank_from_dataset
from slotread.eval.baseline import evaluate_baseline, evaluate_knn, tfidf_predictor
from slotread.eval.datasets import Item, load_dataset
from tests.eval.banking77 import write_banking77

TRAIN = [
    ("where is my new card", "card_arrival"),
    ("my card has not arrived yet", "card_arrival"),
    ("card still not delivered", "card_arrival"),
    ("i want my money back", "request_refund"),
    ("please refund this payment", "request_refund"),
    ("refund the purchase please", "request_refund"),
]


def write_set(root: Path) -> None:
    # pin_blocked never occurs in train: the baseline gives it probability 0
    test = [
        ("my card has still not arrived", "card_arrival"),
        ("i want a refund", "request_refund"),
        ("my pin is blocked", "pin_blocked"),
    ]
    write_banking77(root, ["card_arrival", "request_refund", "pin_blocked"], {"train": TRAIN, "test": test})


def test_the_baseline_learns_the_train_split(tmp_path: Path) -> None:
    write_set(tmp_path)
    predict = tfidf_predictor(load_dataset("banking77", "train", data_dir=tmp_path))
    card = predict(Item("x", "my card has still not arrived", 0)).probabilities
    refund = predict(Item("y", "i want a refund", 1)).probabilities
    assert card.argmax() == 0 and refund.argmax() == 1
    assert card.sum() == pytest.approx(1.0) and card[2] == 0.0


def test_the_baseline_writes_a_run_folder_like_a_model(tmp_path: Path) -> None:
    write_set(tmp_path)
    test = load_dataset("banking77", data_dir=tmp_path)
    train = load_dataset("banking77", "train", data_dir=tmp_path)
    metrics = evaluate_baseline(test, train, tmp_path / "run", progress=False)
    assert metrics["system"] == "tfidf-logreg" and metrics["items"] == 3
    assert metrics["accuracy"] == pytest.approx(2 / 3) and "reads_per_item" not in metrics
    rows = list(csv.DictReader((tmp_path / "run" / "predictions.csv").read_text().splitlines()))
    assert [row["correct"] for row in rows] == ["1", "1", "0"] and rows[0]["reads"] == ""
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"] == ["banking77", "train"]
    assert (tmp_path / "run" / "reliability.png").exists()


def test_the_baseline_needs_two_classes_to_learn(tmp_path: Path) -> None:
    write_set(tmp_path)
    test = load_dataset("banking77", data_dir=tmp_path)
    with pytest.raises(EvalError, match="at least two classes"):
        evaluate_baseline(test, replace(test, split="train", items=test.items[:1]), tmp_path / "run")


def test_the_neighbour_vote_writes_a_run_folder_like_a_model(tmp_path: Path) -> None:
    write_set(tmp_path)
    test = load_dataset("banking77", data_dir=tmp_path)
    bank = bank_from_dataset(load_dataset("banking77", "train", data_dir=tmp_path), test)
    metrics = evaluate_knn(test, bank, 3, tmp_path / "run", progress=False)
    assert metrics["system"] == "bm25-vote-3" and metrics["items"] == 3
    # card and refund messages find their own labels; pin_blocked is in no bank example
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    rows = list(csv.DictReader((tmp_path / "run" / "predictions.csv").read_text().splitlines()))
    p = [float(rows[0][f"p:{name}"]) for name in ("card_arrival", "request_refund", "pin_blocked")]
    assert sum(p) == pytest.approx(1.0) and p[2] == pytest.approx(
        (1 / 3) / (3 + 1e-3 * 2 + 1)
    )  # weights 1 + 0.001·(3 − j)/3
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["neighbours"] == 3 and info["example_bank"]["source"] == "banking77 train"
    with pytest.raises(EvalError, match="at least 1"):
        evaluate_knn(test, bank, 0, tmp_path / "other", progress=False)
