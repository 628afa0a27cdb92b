"""The OpenAI Decisions wire format ⇄ System One bodies (no model needed)."""

from typing import Any

import pytest

from slotread.api.decisions import from_systemone, parse_request, to_systemone
from slotread.errors import InvalidRequest

REQUEST: dict[str, Any] = {
    "model": "jev-latest",
    "input": [
        {"role": "user", "content": "I was charged twice."},
        {"role": "user", "content": [{"type": "input_text", "text": "Please help."}]},
    ],
    "questions": [
        {"type": "predicate", "name": "billing", "instructions": "The message is about billing."},
        {"type": "choice", "choices": [{"value": "calm"}, {"value": "angry", "description": "upset"}]},
        {"type": "score", "name": "urgency", "levels": [{"label": "low"}, {"label": "high", "description": "today"}]},
    ],
    "x_seed": 3,
    "x_permutations": 2,
    "x_calibration": "contextual",
    "x_coverage": 0.9,
}


def test_a_request_becomes_the_system_one_body_asking_the_same_questions() -> None:
    assert to_systemone(parse_request(REQUEST)) == {
        "model": "jev-latest",
        "state": "I was charged twice.\n\nPlease help.",
        "questions": {
            "0": {"type": "noul", "instructions": "The message is about billing."},
            "1": {"type": "choice", "criteria": {"calm": None, "angry": "upset"}, "instructions": None},
            "2": {"type": "score", "criteria": ["low", "high: today"], "instructions": None},
        },
        "x_seed": 3,
        "x_permutations": 2,
        "x_calibration": "contextual",
        "x_coverage": 0.9,
    }


def test_answers_come_back_as_a_list_in_question_order() -> None:
    systemone = {
        "model": "m",
        "answers": {
            "0": {"type": "noul", "noul": 0.8, "x_reads": 1},
            "1": {
                "type": "choice",
                "choice": "angry",
                "probabilities": {"calm": 0.25, "angry": 0.75},
                "confidence": 0.5,
            },
            "2": {
                "type": "score",
                "score": 0.9,
                "legend": {"0": "low", "1": "high"},
                "probabilities": {"0": 0.1, "1": 0.9},
                "confidence": 0.8,
            },
        },
        "usage": {"input_tokens": 40, "output_tokens": 3},
    }
    response = from_systemone(systemone, parse_request(REQUEST))
    predicate, choice, score = response["answers"]
    assert predicate == {
        "type": "predicate",
        "name": "billing",
        "probability": 0.8,
        "confidence": pytest.approx(0.6),
        "x_reads": 1,
    }
    assert choice == {
        "type": "choice",
        "name": None,
        "choice": "angry",
        "probabilities": [{"value": "calm", "probability": 0.25}, {"value": "angry", "probability": 0.75}],
        "confidence": 0.5,
    }
    assert score["probabilities"] == [
        {"label": "low", "value": 0, "probability": 0.1},
        {"label": "high", "value": 1, "probability": 0.9},
    ]
    assert (score["name"], score["score"], score["confidence"]) == ("urgency", 0.9, 0.8)
    assert response["usage"] == {"input_tokens": 40, "output_tokens": 3, "total_tokens": 43}


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"input": ""}, ["body", "input"]),
        ({"questions": []}, ["body", "questions"]),
        (
            {"questions": [{"type": "choice", "choices": [{"value": "a"}]}]},
            ["body", "questions", 0, "choice", "choices"],
        ),
        (
            {"questions": [{"type": "choice", "choices": [{"value": "a"}, {"value": "a"}]}]},
            ["body", "questions", 0, "choice", "choices"],
        ),
        (
            {"questions": [{"type": "score", "levels": [{"label": str(i)} for i in range(11)]}]},
            ["body", "questions", 0, "score", "levels"],
        ),
        ({"questions": [{"type": "noul"}]}, ["body", "questions", 0]),
        (
            {"questions": [{"type": "predicate", "name": "a"}, {"type": "predicate", "name": "a"}]},
            ["body", "questions"],
        ),
        ({"input": [{"role": "system", "content": "x"}]}, ["body", "input", "list[UserMessage]", 0, "role"]),
    ],
)
def test_problems_are_located_in_the_decisions_body(change: dict[str, Any], loc: list[Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request({**REQUEST, **change})
    assert loc in [d["loc"] for d in caught.value.detail]


def test_x_readout_passes_through() -> None:
    body = to_systemone(parse_request({**REQUEST, "x_readout": True}))
    assert body["x_readout"] is True


def test_example_options_pass_through_to_system_one() -> None:
    body = to_systemone(parse_request({**REQUEST, "x_examples": 8, "x_shortlist": 5}))
    assert (body["x_examples"], body["x_shortlist"]) == (8, 5)
    assert "x_examples" not in to_systemone(parse_request(REQUEST))


@pytest.mark.parametrize(
    ("question", "loc", "msg"),
    [
        (
            {"type": "predicate", "id": "billing", "instructions": "About billing?"},
            ["body", "questions", 0, "id"],
            "unknown field 'id'; known fields: choices, instructions, levels, name, type",
        ),
        (
            {"type": "predicate", "name": "b", "instruction": "About billing?"},
            ["body", "questions", 0, "instruction"],
            "unknown field 'instruction'; did you mean 'instructions'?",
        ),
        (
            {"type": "choice", "choices": [{"value": "a"}, {"value": "b", "descripton": "bee"}]},
            ["body", "questions", 0, "choices", 1, "descripton"],
            "unknown field 'descripton'; did you mean 'description'?",
        ),
        (
            {"type": "score", "levels": [{"lable": "low"}, {"label": "high"}]},
            ["body", "questions", 0, "levels", 0, "lable"],
            "unknown field 'lable'; did you mean 'label'?",
        ),
    ],
)
def test_an_unknown_field_in_a_question_is_refused_with_the_closest_known_one(
    question: dict[str, Any], loc: list[Any], msg: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request({**REQUEST, "questions": [question]})
    assert {"loc": loc, "msg": msg, "type": "extra_forbidden"} in caught.value.detail


def test_x_fields_in_questions_and_unknown_top_level_fields_pass() -> None:
    # vLLM's Decisions request carries safety_identifier at the top level; input messages may carry a type.
    body = {
        **REQUEST,
        "safety_identifier": "user-7",
        "input": [{"role": "user", "type": "message", "content": "I was charged twice."}],
        "questions": [{**REQUEST["questions"][1], "x_note": "mine"}],
    }
    assert to_systemone(parse_request(body))["questions"]["0"]["type"] == "choice"
