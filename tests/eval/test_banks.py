"""Example banks in evaluation: built from a train split without the evaluated texts, checked, described."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slotread.decider import read_example_bank
from slotread.errors import EvalError, InvalidRequest
from slotread.eval.banks import bank_from_dataset, bank_info, check_bank
from slotread.eval.datasets import Dataset, Item, Task

TASK = Task(
    "choice", {"type": "choice", "instructions": "Which?", "criteria": {"card": None, "refund": None}}, ("c", "r")
)
TRAIN = Dataset(
    "toy", "train", TASK, (Item("0", "where is my card", 0), Item("1", "Refund  ME", 1), Item("2", "money back", 1))
)
TEST = Dataset("toy", "test", TASK, (Item("0", "refund me", 1), Item("1", "card missing", 0)))


def test_a_bank_from_a_train_split_leaves_out_the_evaluated_texts() -> None:
    bank = bank_from_dataset(TRAIN, TEST)
    # "Refund  ME" is "refund me" with whitespace collapsed and case folded
    assert [(e.state, e.answer) for e in bank.examples] == [("where is my card", "card"), ("money back", "refund")]
    assert bank.source == "toy train without the 1 texts toy test also holds"
    check_bank(bank, TEST)
    info = bank_info(bank)
    assert info["examples"] == 2 and info["schema"] == bank.schema and len(info["sha256"]) == 64
    assert bank_from_dataset(TRAIN, replace(TEST, items=TEST.items[1:])).source == "toy train"


def test_a_bank_file_holding_an_evaluated_text_or_another_question_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bank.jsonl"
    lines = [{"question": TASK.question}, {"state": "card  Missing", "answer": "card"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(InvalidRequest, match=r"1 of 1 items of .*bank\.jsonl also appear in toy test.*--example-bank"):
        check_bank(read_example_bank(path), TEST)
    lines[0] = {"question": {**TASK.question, "instructions": "Which topic?"}}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(EvalError, match="serves another question"):
        check_bank(read_example_bank(path), TEST)
