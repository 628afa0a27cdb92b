"""A request answered by learned readouts (``x_readout``): refuse what is missing, then finish each answer.

Before reading, ``refuse_missing_readouts`` answers 422 when a question's schema has no readout here,
or its readout reads an example bank (a vote, a lexical or an encoder partner) that no bank serves.
After each read, ``readout_answer`` replaces the answer with its readout's, given the partners' parts.
"""

from __future__ import annotations

from collections.abc import Mapping

from slotread.core.answers import Answer
from slotread.core.questions import Decision
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.readouts.readout import Readout
from slotread.quality.readouts.store import ReadoutStore


def refuse_missing_readouts(
    decision: Decision, readouts: ReadoutStore | None, banks: ExampleBanks, schemas: Mapping[str, str]
) -> None:
    """Raise InvalidRequest naming every question of ``decision`` that ``readouts`` (None: none loaded)
    cannot answer (``schemas``: each question's schema hash by question id)."""
    if readouts is None:
        msg = "no readouts are loaded here; fit one with `slotread fit` and load it with --readout DIR"
        raise InvalidRequest.at(["body", "x_readout"], msg)
    problems: list[ErrorDetail] = []
    for question in decision.questions:
        problem = readouts.problem(question.id, schemas[question.id], banks.get(schemas[question.id]) is not None)
        if problem:
            problems.append({"loc": ["body", "x_readout"], "msg": problem, "type": "value_error"})
    if problems:
        raise InvalidRequest(problems)


def readout_answer(
    answer: Answer, state: str, schema: str, readout: Readout, readouts: ReadoutStore, bank: ExampleBank | None
) -> Answer:
    """The answer of ``schema``'s readout on a raw answer to a question about ``state``, given its bank's
    vote, its lexical classifier's q̃ and its embedding classifier's ẽ where the readout adds them."""
    vote = lexical = None
    if readout.vote_neighbours:
        assert bank is not None  # refuse_missing_readouts refused the decision otherwise
        vote = bank.vote(state, readout.vote_neighbours)
    if readout.lexical_weight is not None:
        lexical = readouts.lexical(schema, state)
    dense = readouts.dense(schema, state) if readout.encoder is not None else None
    return readout.answer(answer, vote, lexical, dense)
