"""Fit one question's calibration from labelled examples: the Python API behind ``slotread calibrate``.

Each labelled item is read through the Decider, its text as the state, with ``x_calibration:
contextual`` so that the content-free distributions are read on the way (once). The raw reads (label
logits in option order) give the temperature (``quality.calibration.fit_temperature``) and, under
each of none, contextual and temperature calibration, the items' conformal scores 1 − p(gold). The
result is one artifact for (model, schema). Data that overlaps the evaluation split named by ``exclude`` is
refused: a calibration fitted on the items it is judged on would look better than it is.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slotread.api.systemone import answer_name, parse_request, to_decision
from slotread.core.questions import Question
from slotread.decider import Decider
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.quality.answering import CONTENT_FREE_STATES
from slotread.quality.artifact import CONFORMAL_METHODS, Calibration, schema_hash
from slotread.quality.calibration import calibrate_reads, fit_temperature, mean_nll, temperature_scale
from slotread.quality.conformal import nonconformity

_NOUL_LABELS = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}


@dataclass(frozen=True)
class LabelledItem:
    """One labelled example: an id, the text (the state), and the gold answer as the data gives it."""

    id: str
    text: str
    label: str | bool | int


@dataclass(frozen=True)
class Fit:
    """A fitted artifact and what it was fitted on: raw read logits (N, R, n) and gold option indices (N,)."""

    calibration: Calibration
    logits: np.ndarray
    gold: np.ndarray

    def summary(self) -> dict[str, float]:
        """In-sample numbers: accuracy of the raw answers, NLL before (T = 1) and after the fitted temperature."""
        temperature = self.calibration.temperature or 1.0
        answers = temperature_scale(self.logits, 1.0).mean(axis=1)  # (N, n)
        return {
            "accuracy": float((answers.argmax(axis=1) == self.gold).mean()),
            "nll_raw": mean_nll(self.logits, self.gold),
            "nll_fitted": mean_nll(self.logits, self.gold, temperature),
        }


def normalised(text: str) -> str:
    """How texts are compared for overlap: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def read_labelled(path: Path, text_column: str = "text", label_column: str = "label") -> list[LabelledItem]:
    """The items of a CSV file (with a header) or a JSONL file (one object per line).

    An ``id`` column or field names an item; without one its id is ``sha256:`` and the first 16 hex
    digits of the hash of its normalised text. Raises InvalidRequest naming a missing column.
    """
    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        try:
            rows: list[dict[str, Any]] = [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError as exc:
            raise InvalidRequest.at([path.name], f"invalid JSON line: {exc}", "json_invalid") from None
    else:
        with path.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
    for index, row in enumerate(rows):
        for column in (text_column, label_column):
            if column not in row:
                raise InvalidRequest.at([path.name, index, column], f"row {index} has no {column!r} column")
    return [
        LabelledItem(
            str(row.get("id") or "sha256:" + hashlib.sha256(normalised(row[text_column]).encode()).hexdigest()[:16]),
            str(row[text_column]),
            row[label_column],
        )
        for row in rows
    ]


def _gold(question: Question, label: str | bool | int) -> int | None:
    """The option index a label denotes: an option name; yes/no/true/false/1/0 for a noul; a level index
    or text for a score."""
    value = label
    if isinstance(label, str) and question.kind == "noul":
        value = _NOUL_LABELS.get(label.strip().casefold(), label)
    elif isinstance(label, str) and question.kind == "score" and label.strip().isdigit():
        value = int(label)
    name = answer_name(question, value)
    return None if name is None else [o.name for o in question.options].index(name)


def refuse_overlap(items: Sequence[LabelledItem], exclude: Sequence[str], excluded: str = "") -> None:
    """Raise InvalidRequest if any item's text is also in ``exclude`` (compared ``normalised``)."""
    held_out = {normalised(text) for text in exclude}
    overlap = [item for item in items if normalised(item.text) in held_out]
    if overlap:
        msg = (
            f"{len(overlap)} of {len(items)} items also appear in the excluded split {excluded or ''} "
            f"(texts compared with whitespace collapsed and case folded), e.g. {overlap[0].text!r}; "
            "fit on data that the evaluation does not use"
        )
        raise InvalidRequest.at(["data"], msg, "overlap")


def calibrate(
    decider: Decider,
    questions: dict[str, Any],
    items: Sequence[LabelledItem],
    *,
    question: str | None = None,
    exclude: Sequence[str] = (),
    data: str = "",
    excluded: str = "",
) -> Fit:
    """Fit the calibration of one question of ``questions`` (a System One body without the state: its
    ``questions`` and optional ``instructions`` and ``x_`` read options) on ``items``.

    ``exclude`` holds the texts of the evaluation split; ``data`` and ``excluded`` name the files in the
    artifact. Raises InvalidRequest (nothing is read) for overlapping data, a label that is no answer of
    the question, or a question that is not there or depends on others.
    """
    refuse_overlap(items, exclude, excluded)
    asked = questions.get("questions")
    if not isinstance(asked, dict) or not asked:
        raise InvalidRequest.at(["questions"], "the questions file needs a 'questions' object")
    if question is None and len(asked) != 1:
        raise InvalidRequest.at(["questions"], f"{len(asked)} questions: name the one to calibrate (--question)")
    qid = question if question is not None else next(iter(asked))
    if qid not in asked:
        raise InvalidRequest.at(["questions", qid], f"no question {qid!r} in the questions file")
    if not items:
        raise InvalidRequest.at(["data"], "no labelled items")
    fields = {key: value for key, value in questions.items() if key not in ("questions", "x_coverage")}
    template = {**fields, "questions": {qid: asked[qid]}, "x_calibration": "contextual"}
    decision = to_decision(parse_request({**template, "state": items[0].text}))
    (parsed,) = decision.questions
    if parsed.prerequisites:
        raise InvalidRequest.at(["questions", qid], "calibrate a question that depends on no other question")
    if decision.samples == "auto":
        raise InvalidRequest.at(["x_samples"], "'auto' reads items unevenly; calibrate with a number of samples")
    gold = [_gold(parsed, item.label) for item in items]
    problems: list[ErrorDetail] = [
        {"loc": ["data", index, "label"], "msg": f"{item.label!r} is not an answer of {qid!r}", "type": "value_error"}
        for index, (item, g) in enumerate(zip(items, gold, strict=True))
        if g is None
    ]
    if problems:
        raise InvalidRequest(problems)
    logits = []
    for item in items:
        answer = decider.answer({**template, "state": item.text}).answers[qid]
        assert answer is not None  # no ask_if: always asked
        logits.append(np.stack([read.logits for read in answer.reads]))
        shifts = [read.shift for read in answer.reads]  # the same for every item
    schema = schema_hash(parsed, decision.instructions)
    ids = [item.id for item in items]
    fitted_on = {
        "data": data,
        "items": len(items),
        "ids": ids,
        "ids_sha256": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest(),
        "excluded": excluded,
        "excluded_items": len(exclude),
        "request": {"x_permutations": decision.permutations, "x_samples": decision.samples, "x_seed": decision.seed},
    }
    stacked, gold_indices = np.stack(logits), np.array(gold)
    temperature = fit_temperature(stacked, gold_indices)
    content_free = decider.calibrations.content_free(schema)
    conformal: dict[str, np.ndarray] = {
        method: nonconformity(
            np.stack([calibrate_reads(z, shifts, method, temperature, content_free).mean(axis=0) for z in stacked]),
            gold_indices,
        )
        for method in CONFORMAL_METHODS
    }
    calibration = Calibration(
        model=decider.name,
        schema=schema,
        kind=parsed.kind,
        options=tuple(o.name for o in parsed.options),
        temperature=temperature,
        content_free=content_free,
        content_free_states=CONTENT_FREE_STATES,
        conformal=conformal,
        fitted_on=fitted_on,
    )
    return Fit(calibration, stacked, gold_indices)
