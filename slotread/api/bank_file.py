"""The example bank file (``slotread serve --example-bank FILE``) ⇄ core values.

A bank is JSON Lines: a header line with the System One question object it serves (and, optionally,
the request-wide ``instructions`` its requests carry), then one solved example per line:

    {"question": {"type": "choice", "instructions": "Which topic?", "criteria": {"card arrival": null, ...}}}
    {"state": "I still have not received my new card", "answer": "card arrival"}
    {"state": {"subject": "refund", "body": "..."}, "answer": "request refund"}

A request's question is served by the bank whose question has the same schema: type, instructions
and options (names and descriptions, in order), and the same request-wide instructions
(``quality.artifact.schema_hash``); question ids do not matter. ``state`` is a string, or JSON shown
as JSON, as in a request. ``answer`` names an option as ``ask_if`` does: a choice's option name, a
noul's yes/no (or true/false), a score's level index or level text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from slotread.api.systemone import WireQuestion, _answer_name, _question, render_state, render_text
from slotread.core.questions import Question
from slotread.errors import ExampleBankError
from slotread.prompt.render import SolvedExample

_WIRE_QUESTION: TypeAdapter[Any] = TypeAdapter(WireQuestion)


@dataclass(frozen=True)
class BankData:
    """A bank's question (its id is meaningless), request-wide instructions and solved examples."""

    question: Question
    instructions: str | None
    examples: tuple[SolvedExample, ...]


def bank_question(body: Any, source: str) -> Question:
    """A System One question object as the core Question a bank serves; ExampleBankError if malformed."""
    try:
        wire = _WIRE_QUESTION.validate_python(body)
    except ValidationError as exc:
        raise ExampleBankError(f"{source}: the question is not a System One question object: {exc}") from None
    if wire.depends_on or wire.ask_if:
        raise ExampleBankError(f"{source}: a bank's question cannot depend on other questions")
    question, _ = _question("bank", wire, {})
    return question


def parse_bank(header: Any, rows: Iterable[tuple[int, Any]], source: str) -> BankData:
    """A bank from its header object and (line number, example object) rows; ExampleBankError if malformed."""
    if not isinstance(header, dict) or "question" not in header:
        raise ExampleBankError(f"{source}: the first line must be an object with the bank's 'question'")
    question = bank_question(header["question"], source)
    examples = []
    for line, row in rows:
        if not isinstance(row, dict) or row.get("state") is None or "answer" not in row:
            raise ExampleBankError(f"{source}:{line}: expected an object with 'state' and 'answer'")
        answer = row["answer"]
        name = _answer_name(question, answer) if isinstance(answer, str | bool | int) else None
        if name is None:
            raise ExampleBankError(f"{source}:{line}: {answer!r} is not an answer of the bank's question")
        examples.append(SolvedExample(render_state(row["state"]), name))
    return BankData(question, render_text(header.get("instructions")), tuple(examples))


def read_bank(path: Path) -> BankData:
    """Read a bank file (module docstring); ExampleBankError names the file, the line and the problem."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ExampleBankError(f"cannot read the example bank {path}: {exc.strerror}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ExampleBankError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not rows:
        raise ExampleBankError(f"{path}: the example bank is empty")
    return parse_bank(rows[0][1], rows[1:], str(path))
