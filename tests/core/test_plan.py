import numpy as np

from slotread.core.aggregate import aggregate_reads
from slotread.core.answers import Answer, Read
from slotread.core.plan import is_asked, plan_stages
from slotread.core.questions import Condition, Option, Question

YES_NO = (Option("yes"), Option("no"))


def noul(qid: str, depends: tuple[str, ...] = (), ask_if: tuple[Condition, ...] = ()) -> Question:
    return Question(qid, "noul", None, YES_NO, depends, ask_if)


def answered(question: Question, p_yes: float) -> Answer:
    p = np.array([[p_yes, 1 - p_yes]])
    return Answer(question, aggregate_reads(p), (Read(0, np.log(p[0]), 1.0),))


def test_independent_questions_form_one_stage_in_request_order() -> None:
    questions = (noul("b"), noul("a"), noul("c"))
    assert plan_stages(questions) == [questions]


def test_stages_follow_dependencies() -> None:
    a, b = noul("a"), noul("b")
    c = noul("c", depends=("a",))
    d = noul("d", ask_if=(Condition("c", frozenset({"yes"})),))
    e = noul("e", depends=("b",))
    assert plan_stages((a, b, c, d, e)) == [(a, b), (c, e), (d,)]


def test_ask_if_needs_an_allowed_top_answer() -> None:
    first = noul("first")
    later = noul("later", ask_if=(Condition("first", frozenset({"yes"})),))
    assert is_asked(later, {"first": answered(first, 0.9)})
    assert not is_asked(later, {"first": answered(first, 0.1)})
    assert not is_asked(later, {"first": None})
    assert is_asked(noul("free"), {})
