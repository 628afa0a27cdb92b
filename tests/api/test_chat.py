"""Schema-mode chat completions ⇄ System One, without a model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from slotread.api.chat import from_systemone, letter_label, relocate, to_systemone
from slotread.api.systemone import parse_request, to_decision
from slotread.errors import InvalidRequest

SCHEMA = {
    "questions": [
        {"id": "urgent", "type": "noul", "instructions": "In a hurry?", "criteria": {"true": "today"}},
        {
            "id": "intent",
            "type": "choice",
            "options": [{"name": "refund", "description": "money back"}, "replacement"],
            "depends_on": ["urgent"],
            "alone": True,
        },
        {"id": "mood", "type": "score", "levels": ["calm", "annoyed", "furious"], "ask_if": {"urgent": ["yes"]}},
    ],
    "instructions": "Support triage.",
    "auto_max": 6,
}


def chat_body(schema: Any = SCHEMA, state: str = ' {"text": "rent is due"} ', **extra: Any) -> dict[str, Any]:
    system = schema if isinstance(schema, str) else json.dumps(schema)
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": state}], **extra}


def locs(body: Any) -> list[list[Any]]:
    with pytest.raises(InvalidRequest) as caught:
        to_systemone(body)
    return [d["loc"] for d in caught.value.detail]


def test_the_schema_becomes_a_systemone_body() -> None:
    schema = to_systemone(chat_body(seed=5, model="m"))
    body = schema.body
    assert body["state"] == '{"text": "rent is due"}'  # the user's text, verbatim
    assert (body["samples"], body["auto_max"], body["seed"], body["model"]) == ("auto", 6, 5, "m")
    assert body["questions"]["intent"] == {
        "type": "choice",
        "criteria": {"refund": "money back", "replacement": None},
        "depends_on": ["urgent"],
        "alone": True,
    }
    assert body["questions"]["mood"]["criteria"] == ["calm", "annoyed", "furious"]
    decision = to_decision(parse_request(body))
    assert [q.id for q in decision.questions] == ["urgent", "intent", "mood"]
    assert decision.questions[1].alone and decision.samples == "auto" and decision.auto_max == 6
    assert schema.questions["mood"] == ("score", ["calm", "annoyed", "furious"])
    # the schema's own seed wins over the request's, and x_samples keeps slotread's meaning
    assert to_systemone(chat_body({**SCHEMA, "seed": 1}, seed=5)).body["seed"] == 1
    assert "samples" not in to_systemone(chat_body({**SCHEMA, "x_samples": 2})).body


def test_bad_chat_requests_are_located_in_the_chat_body() -> None:
    content = ["body", "messages", 0, "content"]
    assert locs({"messages": [{"role": "user", "content": "x"}]}) == [["body", "messages"]]
    assert locs(chat_body("not json")) == [content]
    assert locs(chat_body({"questions": {}})) == [content]
    dup = {"questions": [{"id": "a", "type": "noul"}, {"id": "a", "type": "noul"}]}
    assert locs(chat_body(dup)) == [[*content, "questions", 1, "id"]]
    twice = {"questions": [{"id": "a", "type": "choice", "options": ["x", "x"]}]}
    assert locs(chat_body(twice)) == [[*content, "questions", 0, "options", 1]]
    assert locs(chat_body({"questions": [{"id": "a", "type": "rank"}]})) == [[*content, "questions", 0, "type"]]
    image = chat_body()
    image["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    assert locs(image) == [["body", "messages", 1, "content"]]


def test_systemone_problems_move_into_the_schema() -> None:
    schema = to_systemone(chat_body({**SCHEMA, "auto_max": 99, "think": True}))
    with pytest.raises(InvalidRequest) as caught:
        to_decision(parse_request(schema.body))
    moved = relocate(caught.value.detail, schema)
    assert [d["loc"] for d in moved] == [
        ["body", "messages", 0, "content", "auto_max"],
        ["body", "messages", 0, "content", "think"],
    ]
    one = to_systemone(
        chat_body({"questions": [{"id": "a", "type": "noul"}, {"id": "b", "type": "choice", "options": ["x"]}]})
    )
    with pytest.raises(InvalidRequest) as caught:
        to_decision(parse_request(one.body))
    assert relocate(caught.value.detail, one)[0]["loc"][:6] == ["body", "messages", 0, "content", "questions", 1]


def test_letter_labels() -> None:
    assert [letter_label(i) for i in (0, 1, 25, 26, 27, 254)] == ["A", "B", "Z", "AA", "AB", "IU"]


def test_answers_take_that_servers_shape() -> None:
    schema = to_systemone(chat_body())
    response = {
        "model": "m",
        "answers": {
            "urgent": {
                "type": "noul",
                "noul": 0.75,
                "x_stderr": 0.1,
                "x_agreement": 0.5,
                "x_entropy": 0.8,
                "x_label_mass": 0.9,
                "x_reads": 2,
            },
            "intent": {
                "type": "choice",
                "choice": "replacement",
                "probabilities": {"refund": 0.25, "replacement": 0.75},
                "confidence": 0.5,
                "x_entropy": 0.8,
                "x_label_mass": 0.9,
                "x_reads": 1,
            },
            "mood": {
                "type": "score",
                "score": 1.5,
                "legend": {"0": "calm", "1": "annoyed", "2": "furious"},
                "probabilities": {"0": 0.1, "1": 0.3, "2": 0.6},
                "confidence": 0.4,
                "x_stderr": {"0": 0.01, "1": 0.02, "2": 0.03},
                "x_agreement": 1.0,
                "x_entropy": 0.8,
                "x_label_mass": 0.9,
                "x_reads": 4,
            },
        },
        "usage": {"input_tokens": 30, "output_tokens": 3},
    }
    completion = from_systemone(response, schema)
    assert completion["object"] == "chat.completion" and completion["usage"]["total_tokens"] == 33
    content = json.loads(completion["choices"][0]["message"]["content"])
    answers = content["answers"]
    assert answers["urgent"] == {
        "type": "noul",
        "label": "yes",
        "confidence": 0.75,
        "probabilities": {"yes": 0.75, "no": 0.25},
        "noul": 0.75,
        "stderr": 0.1,
        "agreement": 0.5,
    }
    assert answers["intent"] == {
        "type": "choice",
        "label": "B",
        "confidence": 0.75,
        "probabilities": {"refund": 0.25, "replacement": 0.75},
        "choice": "replacement",
    }
    mood = answers["mood"]
    assert (mood["label"], mood["level"], mood["score"], mood["stderr"]) == ("3", "furious", 2.5, 0.03)
    assert mood["probabilities"] == {"calm": 0.1, "annoyed": 0.3, "furious": 0.6}
    assert content["diagnostics"]["questions"]["mood"]["x_reads"] == 4
    response["answers"]["mood"] = None
    assert json.loads(from_systemone(response, schema)["choices"][0]["message"]["content"])["answers"]["mood"] is None
