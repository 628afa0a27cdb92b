"""The read plan: stages of questions, and which questions of a stage are asked.

A question's stage is one more than the latest stage among the questions it depends on (its
``depends_on`` and ``ask_if`` targets), so a stage only needs answers from earlier stages. Within a
stage every read is independent and goes to the engine in one batch.
"""

from __future__ import annotations

from collections.abc import Mapping

from slotread.core.answers import Answer
from slotread.core.questions import Question


def plan_stages(questions: tuple[Question, ...]) -> list[tuple[Question, ...]]:
    """Group questions into stages, keeping request order inside each stage.

    Every prerequisite must name an earlier question (the api layer checks this for callers).
    """
    level: dict[str, int] = {}
    for question in questions:
        level[question.id] = 1 + max((level[p] for p in question.prerequisites), default=-1)
    stages: list[list[Question]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for question in questions:
        stages[level[question.id]].append(question)
    return [tuple(stage) for stage in stages]


def is_asked(question: Question, answers: Mapping[str, Answer | None]) -> bool:
    """True when every ``ask_if`` condition holds: the earlier answer exists and its top option is allowed.

    A noul's top option is ``yes`` or ``no``; a score's is its level index as a string.
    """
    for condition in question.ask_if:
        earlier = answers.get(condition.question)
        if earlier is None or earlier.top_name not in condition.answers:
            return False
    return True
