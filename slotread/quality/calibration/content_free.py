"""Content-free reads for ``contextual`` and ``binned`` calibration: each question read without its state.

Each question is read on every ``CONTENT_FREE_STATES`` in place of the state, without earlier answers,
under the request's assignments, as isolated branches; p_cf per shift is the mean of their
softmaxes. The store keeps them per schema (``missing_content_free`` names those it lacks); with
solved examples or a shortlist in the prompt they depend on the request's state (through the
retrieved examples), so they are read for each such request and not kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import numpy as np

from slotread.core.aggregate import softmax
from slotread.core.answers import Answer
from slotread.core.questions import Decision, Question
from slotread.core.reads import question_shifts
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.store import CalibrationStore

#: What stands in for the state in a content-free read (Zhao et al. 2021 use "N/A", "" and "[MASK]";
#: "[empty]" replaces the mask token, which is not plain text to a chat model).
CONTENT_FREE_STATES = ("N/A", "", "[empty]")
#: Draws per content-free read on a noisy (diffusion) model, always from seed 0, so the cached
#: distribution does not depend on which request read it first.
CONTENT_FREE_DRAWS = 4


def missing_content_free(
    decision: Decision, store: CalibrationStore, schemas: Mapping[str, str]
) -> dict[str, Question]:
    """The questions whose content-free distributions ``store`` lacks for this request's assignments, one
    per schema, keyed and named by their schema hash and asked unconditionally."""
    missing: dict[str, Question] = {}
    for question in decision.questions:
        schema = schemas[question.id]
        known = store.content_free(schema)
        if schema not in missing and any(s not in known for s in question_shifts(question, decision.permutations)):
            missing[schema] = replace(question, id=schema, depends_on=(), ask_if=())
    return missing


def blank_decisions(decision: Decision, questions: Mapping[str, Question]) -> list[Decision]:
    """``questions`` (asked unconditionally) read on each content-free state: the decision without its
    state and images, read as isolated branches, ``CONTENT_FREE_DRAWS`` draws from seed 0."""
    return [
        replace(
            decision,
            state=state,
            images=(),  # content-free: no image either
            questions=tuple(questions.values()),
            seed=0,
            samples=CONTENT_FREE_DRAWS,
            joint=False,
        )
        for state in CONTENT_FREE_STATES
    ]


def mean_by_shift(answers: Iterable[Answer]) -> dict[int, np.ndarray]:
    """One question's content-free answers (one per state) as shift → the mean of their reads' softmaxes."""
    by_shift: dict[int, list[np.ndarray]] = {}
    for answer in answers:
        for read in answer.reads:
            by_shift.setdefault(read.shift, []).append(softmax(read.logits))
    return {shift: np.mean(ps, axis=0) for shift, ps in by_shift.items()}


def learn_content_free(
    store: CalibrationStore, missing: Mapping[str, Question], found: Mapping[str, Mapping[int, np.ndarray]]
) -> None:
    """Keep the content-free distributions read for ``missing`` (by schema) in ``store``."""
    for schema, question in missing.items():
        learned = Calibration(
            model=store.model,
            schema=schema,
            kind=question.kind,
            options=tuple(o.name for o in question.options),
            content_free=found[schema],
            content_free_states=CONTENT_FREE_STATES,
        )
        store.learn_content_free(learned)
