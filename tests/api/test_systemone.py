"""Validation and shaping of the System One wire format (no model needed)."""

from typing import Any

import pytest

from slotread.api.systemone import (
    QUESTION_FIELDS,
    ChoiceQuestion,
    NoulQuestion,
    ScoreQuestion,
    parse_request,
    render_state,
    render_text,
    to_decision,
)
from slotread.errors import InvalidRequest


def decision(body: Any, **limits: int):
    return to_decision(parse_request(body), **limits)


def problems(body: Any, **limits: int) -> list[dict[str, Any]]:
    with pytest.raises(InvalidRequest) as caught:
        decision(body, **limits)
    detail = caught.value.detail
    assert detail and all({"loc", "msg", "type"} <= set(d) and d["loc"][0] == "body" for d in detail)
    return list(detail)


def locs(body: Any, **limits: int) -> list[list[Any]]:
    return [d["loc"] for d in problems(body, **limits)]


CHOICE = {"type": "choice", "criteria": {"red": None, "green": "the colour of grass"}}


def test_ids_are_any_non_empty_string_and_keep_order() -> None:
    ids = ["plain", "with space", "dots.in.id", "한국어", "🙂", "x" * 300]
    d = decision({"state": "s", "questions": {i: {"type": "noul"} for i in ids}})
    assert [q.id for q in d.questions] == ids


def test_option_names_round_trip_byte_for_byte() -> None:
    names = ["Café", "cafe\u0301", "  padded  ", "UPPER", "upper", "a\nb", "😀"]
    d = decision({"state": "s", "questions": {"q": {"type": "choice", "criteria": dict.fromkeys(names)}}})
    assert [o.name for o in d.questions[0].options] == names


def test_descriptions_render_objects_as_json_not_repr() -> None:
    assert render_text({"a": [1, "é"], "b": None}) == '{"a": [1, "é"], "b": null}'
    assert render_text(["x", True]) == '["x", true]'
    assert render_text("verbatim {not json}") == "verbatim {not json}"
    assert render_text(None) is None
    d = decision(
        {
            "state": "s",
            "instructions": {"role": "triage"},
            "questions": {
                "q": {"type": "choice", "instructions": ["be", "brief"], "criteria": {"a": {"k": 1}, "b": []}}
            },
        }
    )
    assert d.instructions == '{"role": "triage"}'
    assert d.questions[0].instructions == '["be", "brief"]'
    assert [o.description for o in d.questions[0].options] == ['{"k": 1}', "[]"]


def test_state_string_is_verbatim_and_anything_else_is_json() -> None:
    assert render_state("  as is\n") == "  as is\n"
    assert render_state({"user": "Ana", "n": 3}) == '{"user": "Ana", "n": 3}'
    assert render_state(None) == "null"
    assert decision({"state": [1, 2], "questions": {"q": {"type": "noul"}}}).state == "[1, 2]"


def test_noul_criteria_become_yes_and_no_options() -> None:
    d = decision({"state": "s", "questions": {"q": {"type": "noul", "criteria": {"true": "urgent"}}}})
    assert [(o.name, o.description) for o in d.questions[0].options] == [("yes", "urgent"), ("no", None)]
    d = decision({"state": "s", "questions": {"q": {"type": "noul", "criteria": None}}})
    assert [o.name for o in d.questions[0].options] == ["yes", "no"]


def test_score_levels_are_indexed_low_to_high() -> None:
    d = decision({"state": "s", "questions": {"q": {"type": "score", "criteria": ["low", "mid", "high"]}}})
    assert [(o.name, o.description) for o in d.questions[0].options] == [
        ("0", "low"),
        ("1", "mid"),
        ("2", "high"),
    ]


def test_unknown_top_level_fields_are_ignored_and_options_parsed() -> None:
    d = decision(
        {
            "state": "s",
            "questions": {"q": {"type": "noul"}},
            "model": "jev-latest",
            "something_new": {"x": 1},
            "x_seed": 7,
            "x_samples": "auto",
            "joint": True,
        }
    )
    assert (d.seed, d.samples, d.joint) == (7, "auto", True)
    assert (
        decision({"state": "s", "questions": {"q": {"type": "noul"}}, "x_joint": False, "joint": True}).joint is False
    )


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ([], ["body"]),
        ("text", ["body"]),
        ({"questions": {"q": {"type": "noul"}}}, ["body", "state"]),
        ({"state": "s"}, ["body", "questions"]),
        ({"state": "s", "questions": {}}, ["body", "questions"]),
        ({"state": "s", "questions": []}, ["body", "questions"]),
        ({"state": "s", "questions": {"": {"type": "noul"}}}, ["body", "questions"]),
        ({"state": "s", "questions": {"q": {}}}, ["body", "questions", "q"]),
        ({"state": "s", "questions": {"q": "noul"}}, ["body", "questions", "q"]),
        ({"state": "s", "questions": {"q": {"type": "rank"}}}, ["body", "questions", "q"]),
        (
            {"state": "s", "questions": {"q": {"type": "choice"}}},
            ["body", "questions", "q", "choice", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
            ["body", "questions", "q", "choice", "criteria"],
        ),
        (
            {
                "state": "s",
                "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}},
            },
            ["body", "questions", "q", "choice", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": ["a", "b"]}}},
            ["body", "questions", "q", "choice", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": 1, "b": None}}}},
            ["body", "questions", "q", "choice", "criteria", "a"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "score", "criteria": ["one"]}}},
            ["body", "questions", "q", "score", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
            ["body", "questions", "q", "score", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "score", "criteria": {"a": 1}}}},
            ["body", "questions", "q", "score", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}}}},
            ["body", "questions", "q", "noul", "criteria", "maybe"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul", "criteria": "yes means yes"}}},
            ["body", "questions", "q", "noul", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul", "instructions": 5}}},
            ["body", "questions", "q", "noul", "instructions"],
        ),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_seed": "7"}, ["body", "x_seed"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_samples": 0}, ["body", "x_samples"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_samples": 33}, ["body", "x_samples"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_samples": "many"}, ["body", "x_samples"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_joint": "yes"}, ["body", "x_joint"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_permutations": 0}, ["body", "x_permutations"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_permutations": 2.0}, ["body", "x_permutations"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_calibration": "platt"}, ["body", "x_calibration"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_coverage": "0.9"}, ["body", "x_coverage"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_coverage": 1.0}, ["body", "x_coverage"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}, "x_coverage": 0.0}, ["body", "x_coverage"]),
    ],
)
def test_malformed_requests_are_located(body: Any, where: list[Any]) -> None:
    found = locs(body)
    assert any(loc[: len(where)] == where for loc in found), found


def test_every_problem_is_reported_at_once() -> None:
    body = {
        "state": "s",
        "questions": {
            "a": {"type": "choice", "criteria": {"x": None}},
            "b": {"type": "score", "criteria": ["1"]},
        },
    }
    assert len(problems(body)) == 2


def test_question_limit_is_enforced() -> None:
    body = {"state": "s", "questions": {str(i): {"type": "noul"} for i in range(5)}}
    assert locs(body, max_questions=4) == [["body", "questions"]]
    assert len(decision(body, max_questions=5).questions) == 5


def test_dependencies_must_name_earlier_questions() -> None:
    body = {
        "state": "s",
        "questions": {
            "first": {"type": "noul", "depends_on": "later"},
            "later": {"type": "noul", "depends_on": ["first", "nope"]},
        },
    }
    assert locs(body) == [
        ["body", "questions", "first", "depends_on", 0],
        ["body", "questions", "later", "depends_on", 1],
    ]


def test_ask_if_values_must_be_answers_of_the_named_question() -> None:
    body = {
        "state": "s",
        "questions": {
            "kind": CHOICE,
            "urgent": {"type": "noul"},
            "level": {"type": "score", "criteria": ["low", "high"]},
            "a": {"type": "noul", "ask_if": {"kind": ["red", "blue"]}},
            "b": {"type": "noul", "ask_if": {"urgent": [True, "maybe"]}},
            "c": {"type": "noul", "ask_if": {"level": [1, 2, "high", "mid"]}},
            "d": {"type": "noul", "ask_if": {"nobody": ["x"]}},
            "e": {"type": "noul", "ask_if": {"kind": []}},
        },
    }
    assert locs(body) == [
        ["body", "questions", "a", "ask_if", "kind", 1],
        ["body", "questions", "b", "ask_if", "urgent", 1],
        ["body", "questions", "c", "ask_if", "level", 1],
        ["body", "questions", "c", "ask_if", "level", 3],
        ["body", "questions", "d", "ask_if", "nobody"],
        ["body", "questions", "e", "ask_if", "kind"],
    ]


def test_ask_if_maps_values_to_option_names() -> None:
    body = {
        "state": "s",
        "questions": {
            "kind": CHOICE,
            "urgent": {"type": "noul"},
            "level": {"type": "score", "criteria": ["low", "high"]},
            "q": {
                "type": "noul",
                "ask_if": {"kind": ["green"], "urgent": [False], "level": ["high", 0]},
                "depends_on": ["kind", "kind"],
            },
        },
    }
    question = decision(body).questions[-1]
    conditions = {c.question: c.answers for c in question.ask_if}
    assert conditions == {"kind": {"green"}, "urgent": {"no"}, "level": {"1", "0"}}
    assert question.depends_on == ("kind",)
    assert question.prerequisites == ("kind", "urgent", "level")


def test_a_server_may_allow_fewer_options_per_choice() -> None:
    body = {"state": "s", "questions": {"q": {"type": "choice", "criteria": dict.fromkeys("abcd")}}}
    assert len(decision(body, max_options=4).questions[0].options) == 4
    assert locs(body, max_options=3) == [["body", "questions", "q", "choice", "criteria"]]


def test_permutations_default_to_one_and_stop_at_the_limit() -> None:
    body: dict[str, Any] = {"state": "s", "questions": {"q": CHOICE}}
    assert decision(body).permutations == 1
    assert decision({**body, "x_permutations": 16}).permutations == 16
    (problem,) = problems({**body, "x_permutations": 17})
    assert problem["loc"] == ["body", "x_permutations"] and problem["msg"] == "x_permutations must be 1..16, got 17"
    assert decision({**body, "x_permutations": 40}, max_permutations=40).permutations == 40


def test_calibration_defaults_to_none() -> None:
    body: dict[str, Any] = {"state": "s", "questions": {"q": CHOICE}}
    assert decision(body).quality.calibration == "none"
    assert decision({**body, "x_calibration": "batch"}).quality.calibration == "batch"


def test_coverage_is_a_share_and_needs_a_fixed_calibration() -> None:
    body: dict[str, Any] = {"state": "s", "questions": {"q": CHOICE}}
    assert decision(body).quality.coverage is None
    assert decision({**body, "x_coverage": 0.9, "x_calibration": "temperature"}).quality.coverage == 0.9
    assert decision({**body, "x_coverage": 0.9, "x_calibration": "binned"}).quality.calibration == "binned"
    (problem,) = problems({**body, "x_coverage": 0.9, "x_calibration": "batch"})
    assert problem["loc"] == ["body", "x_coverage"] and "batch calibration" in problem["msg"]


def test_x_readout_refuses_what_a_readout_was_not_fitted_under() -> None:
    request = {
        "state": "s",
        "questions": {"q": {"type": "noul"}},
        "x_readout": True,
        "x_permutations": 2,
        "x_calibration": "temperature",
        "x_coverage": 0.9,
        "x_joint": True,
    }
    with pytest.raises(InvalidRequest) as caught:
        to_decision(parse_request(request))
    locs = [problem["loc"] for problem in caught.value.detail]
    assert locs == [["body", "x_permutations"], ["body", "x_calibration"], ["body", "x_coverage"], ["body", "x_joint"]]
    with pytest.raises(InvalidRequest) as caught:
        to_decision(parse_request({"state": "s", "questions": {"q": CHOICE}, "x_readout": True, "x_shortlist": 2}))
    assert [problem["loc"] for problem in caught.value.detail] == [["body", "x_shortlist"]]
    plain = {"state": "s", "questions": {"q": {"type": "noul"}}, "x_readout": True, "x_samples": 4}
    decision = to_decision(parse_request(plain))
    assert decision.readout and decision.samples == 4


def test_examples_and_shortlists_are_read_options_within_range() -> None:
    body = {"state": "s", "questions": {"q": CHOICE}}
    assert (decision(body).quality.examples, decision(body).quality.shortlist) == (0, 0)
    found = decision({**body, "x_examples": 64, "x_shortlist": 2, "x_calibration": "contextual"})
    assert (found.quality.examples, found.quality.shortlist) == (64, 2)
    assert locs({**body, "x_examples": 65}) == [["body", "x_examples"]]
    assert locs({**body, "x_examples": -1}) == [["body", "x_examples"]]
    assert locs({**body, "x_examples": "8"}) == [["body", "x_examples"]]
    assert locs({**body, "x_shortlist": 1}) == [["body", "x_shortlist"]]
    assert locs({**body, "x_shortlist": 256}) == [["body", "x_shortlist"]]


@pytest.mark.parametrize(
    ("extra", "loc", "words"),
    [
        ({"joint": True}, "x_examples", "drop joint"),
        ({"x_joint": True}, "x_examples", "drop joint"),
        ({"x_calibration": "temperature"}, "x_calibration", "'none' or 'contextual'"),
        ({"x_calibration": "batch"}, "x_calibration", "'none' or 'contextual'"),
        ({"x_calibration": "binned"}, "x_calibration", "'none' or 'contextual'"),
        ({"x_coverage": 0.9}, "x_coverage", "conformal scores"),
    ],
)
def test_examples_refuse_read_options_fitted_without_them(extra: dict[str, Any], loc: str, words: str) -> None:
    for field in ("x_examples", "x_shortlist"):
        body = {"state": "s", "questions": {"q": CHOICE}, field: 2, **extra}
        (problem,) = problems(body)
        assert problem["loc"] == ["body", loc.replace("x_examples", field)] and words in problem["msg"]
    # joint false with examples is fine, as are these options without examples
    assert decision({"state": "s", "questions": {"q": CHOICE}, "x_examples": 2, "x_joint": False}).quality.examples == 2
    decision({"state": "s", "questions": {"q": CHOICE}, **extra})


def test_a_null_score_level_is_refused_naming_the_level() -> None:
    # System One's legend echoes each level and its schema takes no null legend value.
    found = problems({"state": "s", "questions": {"q": {"type": "score", "criteria": ["low", None, "high"]}}})
    assert [(d["loc"], d["msg"]) for d in found] == [
        (
            ["body", "questions", "q", "score", "criteria"],
            "Value error, score levels are text, objects or arrays; level 1 is null",
        )
    ]
    levels = ["low", {"text": "mid", "note": None}, ["high", None]]
    d = decision({"state": "s", "questions": {"q": {"type": "score", "criteria": levels}}})
    assert [o.description for o in d.questions[0].options] == ["low", '{"text": "mid", "note": null}', '["high", null]']


@pytest.mark.parametrize(
    ("question", "field", "hint"),
    [
        ({**CHOICE, "instruction": "Which colour?"}, "instruction", "did you mean 'instructions'?"),
        ({"type": "noul", "critera": {"true": "yes"}}, "critera", "did you mean 'criteria'?"),
        ({"type": "noul", "dependson": []}, "dependson", "did you mean 'depends_on'?"),
        (
            {"type": "noul", "weight": 2},
            "weight",
            "known fields: alone, ask_if, criteria, depends_on, instructions, type",
        ),
    ],
)
def test_an_unknown_field_in_a_question_is_refused_with_the_closest_known_one(
    question: dict[str, Any], field: str, hint: str
) -> None:
    found = problems({"state": "s", "questions": {"q": question}})
    assert {
        "loc": ["body", "questions", "q", field],
        "msg": f"unknown field {field!r}; {hint}",
        "type": "extra_forbidden",
    } in found


def test_known_question_fields_x_fields_and_unknown_top_level_fields_pass() -> None:
    questions = {
        # what the official client sends: type, instructions, criteria (null descriptions included)
        "a": {"type": "choice", "instructions": None, "criteria": {"red": None, "green": {"hue": 120}}},
        # vLLM's per-question extensions, and an x_ extension
        "b": {"type": "noul", "criteria": None, "depends_on": ["a"], "ask_if": {"a": ["red"]}, "x_note": "mine"},
    }
    d = decision({"state": "s", "questions": questions, "unknown_top_level": [1], "samples": 1})
    assert [q.id for q in d.questions] == ["a", "b"]


def test_question_fields_are_exactly_the_wire_questions_fields() -> None:
    # One list: a field added to the wire questions must be added to QUESTION_FIELDS, or it would be refused.
    fields = set().union(*(model.model_fields for model in (NoulQuestion, ChoiceQuestion, ScoreQuestion)))
    assert fields == QUESTION_FIELDS


def test_the_example_servers_samples_and_seed_are_x_samples_and_x_seed() -> None:
    plain = decision({"state": "s", "questions": {"q": {"type": "noul"}}, "samples": 3, "seed": 7})
    prefixed = decision({"state": "s", "questions": {"q": {"type": "noul"}}, "x_samples": 3, "x_seed": 7})
    assert (plain.samples, plain.seed) == (prefixed.samples, prefixed.seed) == (3, 7)
    both = {"state": "s", "questions": {"q": {"type": "noul"}}, "samples": 2, "x_samples": 2}
    assert decision(both).samples == 2
    assert locs({**both, "x_samples": 3, "seed": 1, "x_seed": 2}) == [["body", "seed"], ["body", "samples"]]
    assert locs({**both, "x_samples": None, "samples": 33}) == [["body", "samples"]]


def test_auto_threshold_and_auto_max() -> None:
    body = {"state": "s", "questions": {"q": {"type": "noul"}}, "samples": "auto"}
    d = decision({**body, "auto_threshold": 0.1, "auto_max": 8})
    assert (d.samples, d.auto_threshold, d.auto_max) == ("auto", 0.1, 8)
    assert (decision(body).auto_threshold, decision(body).auto_max) == (0.5, 4)
    assert locs({**body, "auto_threshold": 1.5, "auto_max": 33}) == [["body", "auto_threshold"], ["body", "auto_max"]]
    assert locs({**body, "auto_max": 0}) == [["body", "auto_max"]]
    assert locs({**body, "auto_threshold": "0.1"})[0][:2] == ["body", "auto_threshold"]
    # slotread reads once by default: tuning "auto" without asking for it is a mistake worth a 422
    assert locs({**body, "samples": 2, "auto_max": 4}) == [["body", "auto_max"]]


def test_ask_keeps_the_named_questions_and_their_prerequisites() -> None:
    questions = {
        "a": {"type": "noul"},
        "b": {"type": "noul", "depends_on": "a"},
        "c": {"type": "noul", "ask_if": {"b": [True]}},
        "d": {"type": "noul"},
    }
    d = decision({"state": "s", "questions": questions, "ask": ["c"]})
    assert [q.id for q in d.questions] == ["a", "b", "c"]
    assert [q.id for q in decision({"state": "s", "questions": questions, "ask": ["d", "a"]}).questions] == ["a", "d"]
    assert locs({"state": "s", "questions": questions, "ask": ["a", "nope"]}) == [["body", "ask", 1]]
    assert locs({"state": "s", "questions": questions, "ask": []}) == [["body", "ask"]]
    assert locs({"state": "s", "questions": questions, "ask": "a"})[0][:2] == ["body", "ask"]


def test_alone_and_chunks() -> None:
    body = {"state": "s", "questions": {"q": {"type": "noul", "alone": True}, "r": {"type": "noul"}}, "joint": True}
    d = decision({**body, "chunk_rows": 16, "chunk_prompt": "shared"})
    assert [q.alone for q in d.questions] == [True, False]
    assert (d.chunk_rows, d.chunk_prompt) == (16, "shared")
    assert (decision(body).chunk_rows, decision(body).chunk_prompt) == (None, "own")
    assert locs({**body, "chunk_rows": 7}) == [["body", "chunk_rows"]]
    assert locs({**body, "chunk_prompt": "full"})[0][:2] == ["body", "chunk_prompt"]
    assert locs({**body, "questions": {"q": {"type": "noul", "alone": "yes"}}})[0][:4] == [
        "body",
        "questions",
        "q",
        "noul",
    ]


@pytest.mark.parametrize("think", [False, 0])
def test_think_off_is_accepted(think: Any) -> None:
    assert decision({"state": "s", "questions": {"q": {"type": "noul"}}, "think": think}).questions
