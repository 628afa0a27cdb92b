"""Example banks for evaluation: built from a train split (or read from a bank file), kept apart from the
evaluated items, and described in run.json.

A bank that holds an evaluated item's text would show the model (or the neighbour vote) the answer
it is judged on. A bank built from a train split leaves such texts out (and says so); a bank file
that holds one is refused before anything is read. Texts are compared with whitespace collapsed and
case folded (``training.refuse_overlap``, as ``slotread calibrate --exclude`` compares them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from slotread.api.bank_file import bank_question
from slotread.errors import EvalError
from slotread.eval.datasets import Dataset
from slotread.eval.runner import option_names
from slotread.eval.training import drop_overlap, refuse_overlap
from slotread.quality.artifact import schema_hash
from slotread.quality.examples.bank import ExampleBank

logger = logging.getLogger(__name__)


def bank_from_dataset(train: Dataset, evaluated: Dataset) -> ExampleBank:
    """The train items as solved examples of the dataset's question (every item answers it), without
    those whose text is also an ``evaluated`` item's: real splits repeat a few texts (BANKING77's
    train split holds one of subset154's messages), and a bank must not show an item its answer.
    How many were left out is logged, and its source names them (run.json records it)."""
    names = option_names(train.task)
    kept, dropped = without_evaluated(train, evaluated)
    source = train.title
    if dropped:
        source += f" without the {dropped} texts {evaluated.title} also holds"
    pairs = [(item.state, names[item.gold]) for item in kept.items]
    return ExampleBank.from_pairs(bank_question(train.task.question, source), None, pairs, source)


def without_evaluated(train: Dataset, evaluated: Dataset) -> tuple[Dataset, int]:
    """``train`` without the items whose text an ``evaluated`` item also holds, and how many those were (logged)."""
    kept, dropped = drop_overlap(train, evaluated)
    if dropped:
        logger.warning("%s: %d texts that %s also holds left out", train.title, dropped, evaluated.title)
    return kept, dropped


def check_bank(bank: ExampleBank, dataset: Dataset) -> None:
    """Raise EvalError unless ``bank`` serves the dataset's question, InvalidRequest if it shares a text
    with its items (``training.refuse_overlap``)."""
    schema = schema_hash(bank_question(dataset.task.question, dataset.title), None)
    if bank.schema != schema:
        raise EvalError(
            f"the bank {bank.source} serves another question than {dataset.title} asks "
            f"(schema {bank.schema[:16]}, not {schema[:16]}): its header must hold the same question object"
        )
    refuse_overlap(bank, dataset, "--example-bank")


def bank_info(bank: ExampleBank) -> dict[str, Any]:
    """How run.json names a bank: its source, size, schema, a digest of its examples and its retrieval."""
    text = json.dumps([[e.state, e.answer] for e in bank.examples], ensure_ascii=False)
    return {
        "source": bank.source,
        "examples": len(bank),
        "schema": bank.schema,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "retrieval": bank.retrieval,
    }
