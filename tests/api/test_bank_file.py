"""Example bank files: the header's question, the examples' answers, and every way a file can be wrong."""

import json
from pathlib import Path
from typing import Any

import pytest

from slotread.api.bank_file import read_bank
from slotread.api.systemone import parse_request, to_decision
from slotread.errors import ExampleBankError
from slotread.prompt.render import SolvedExample
from slotread.quality.artifact import schema_hash

QUESTION = {"type": "choice", "instructions": "Which topic?", "criteria": {"card": None, "refund": "money back"}}


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_bank_file_serves_the_schema_of_its_question(tmp_path: Path) -> None:
    rows = [
        {"question": QUESTION},
        {"state": "where is my card", "answer": "card"},
        {"state": {"a": 1}, "answer": "refund"},
    ]
    bank = read_bank(write(tmp_path / "bank.jsonl", rows))
    assert bank.examples == (SolvedExample("where is my card", "card"), SolvedExample('{"a": 1}', "refund"))
    request = to_decision(parse_request({"state": "s", "questions": {"any id": QUESTION}}))
    assert schema_hash(bank.question, bank.instructions) == schema_hash(request.questions[0], None)


def test_answers_are_named_as_ask_if_names_them(tmp_path: Path) -> None:
    score = {"type": "score", "criteria": ["low", "high"]}
    bank = read_bank(
        write(tmp_path / "s.jsonl", [{"question": score}, {"state": "a", "answer": 1}, {"state": "b", "answer": "low"}])
    )
    assert [e.answer for e in bank.examples] == ["1", "0"]
    noul = read_bank(
        write(
            tmp_path / "n.jsonl",
            [{"question": {"type": "noul"}, "instructions": "Be brief."}, {"state": "a", "answer": True}],
        )
    )
    assert noul.examples[0].answer == "yes" and noul.instructions == "Be brief."


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        ([], "empty"),
        ([{"state": "a", "answer": "card"}], "first line"),
        ([{"question": {"type": "choice"}}], "not a System One question"),
        ([{"question": {**QUESTION, "depends_on": "x"}}], "cannot depend"),
        ([{"question": QUESTION}, {"state": "a"}], ":2: expected an object"),
        ([{"question": QUESTION}, {"state": "a", "answer": "lost"}], ":2: 'lost' is not an answer"),
    ],
)
def test_a_malformed_bank_names_the_file_and_the_problem(tmp_path: Path, lines: list[Any], words: str) -> None:
    with pytest.raises(ExampleBankError, match=words) as found:
        read_bank(write(tmp_path / "bad.jsonl", lines))
    assert "bad.jsonl" in str(found.value)
    (tmp_path / "broken.jsonl").write_text('{"question": ' + json.dumps(QUESTION) + "}\n{not json\n")
    with pytest.raises(ExampleBankError, match=r"broken\.jsonl:2: not JSON"):
        read_bank(tmp_path / "broken.jsonl")
