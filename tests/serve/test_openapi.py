"""The OpenAPI document declares what the decision routes answer, and what they send matches it."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from slotread.api.responses import DecisionsResponse, SystemOneResponse
from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.serve.openapi import ErrorBody, ValidationFailed
from slotread.settings import Settings
from tests.serve.live import Live, live_server

ANSWERS = {"/v1/systemone": SystemOneResponse, "/v1/decisions": DecisionsResponse}
RETRIED = {"503", "529"}

SYSTEM_ONE: dict[str, Any] = {
    "state": "My card has not arrived.",
    "questions": {
        "card": {"type": "noul", "instructions": "Is this about a card?"},
        "late": {"type": "noul", "ask_if": {"card": [True]}},
        "early": {"type": "noul", "ask_if": {"card": [False]}},
        "tone": {"type": "choice", "criteria": {"calm": None, "angry": {"signs": ["caps"]}}},
        "level": {"type": "score", "criteria": ["low", {"text": "mid"}, ["high"]]},
    },
    "x_permutations": 2,
}
DECISIONS: dict[str, Any] = {
    "input": "My card has not arrived.",
    "questions": [
        {"type": "predicate", "name": "card", "instructions": "The message is about a card."},
        {"type": "choice", "choices": [{"value": "calm"}, {"value": "angry", "description": "upset"}]},
        {"type": "score", "levels": [{"label": "low"}, {"label": "high"}]},
    ],
}


def declared(document: dict[str, Any], path: str, status: str) -> str:
    """The component a route's response of ``status`` refers to."""
    schema = document["paths"][path]["post"]["responses"][status]["content"]["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[-1]
    assert name in document["components"]["schemas"]
    return name


@pytest.mark.parametrize("path", list(ANSWERS))
def test_the_decision_routes_declare_their_answers_and_errors(smollm2_server: Live, path: str) -> None:
    document = httpx.get(smollm2_server.url + "/openapi.json").json()
    responses = document["paths"][path]["post"]["responses"]
    assert set(responses) == {"200", "401", "404", "413", "415", "422", "500", "502", "503", "529"}
    assert declared(document, path, "200").endswith(f".{ANSWERS[path].__name__}")
    assert declared(document, path, "422") == "Error.ValidationFailed"
    for status in set(responses) - {"200", "422", "500"}:
        assert declared(document, path, status) == "Error.ErrorBody"
        assert ("retry-after" in responses[status].get("headers", {})) == (status in RETRIED)


def check(response: httpx.Response, model: type[BaseModel]) -> None:
    """The body is exactly what ``model`` declares (its models forbid undeclared fields)."""
    model.model_validate_json(response.content, strict=True)


def test_what_the_routes_send_matches_the_declared_schemas(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        answered = client.post("/v1/systemone", json=SYSTEM_ONE)
        decided = client.post("/v1/decisions", json=DECISIONS)
        invalid = [
            client.post(
                "/v1/systemone", json={"state": "s", "questions": {"q": {"type": "score", "criteria": [None]}}}
            ),
            client.post("/v1/decisions", json={**DECISIONS, "questions": [{"type": "predicate", "id": "x"}]}),
        ]
        errors = [
            client.post("/v1/systemone", json={**SYSTEM_ONE, "model": "gpt-9"}),
            client.post("/v1/decisions", json={**DECISIONS, "model": "gpt-9"}),
            client.post("/v1/systemone", content=b"{}", headers={"content-encoding": "br"}),
        ]
    assert answered.status_code == 200 and decided.status_code == 200
    check(answered, SystemOneResponse)
    check(decided, DecisionsResponse)
    assert set(answered.json()["answers"]) in ({"card", "late", "tone", "level"}, {"card", "early", "tone", "level"})
    for response in invalid:
        assert response.status_code == 422
        check(response, ValidationFailed)
    assert [r.status_code for r in errors] == [404, 404, 415]
    for response in errors:
        check(response, ErrorBody)


def test_a_server_still_loading_answers_503_with_retry_after(smollm2: LoadedModel) -> None:
    loaded = threading.Event()

    def load() -> Decider:
        assert loaded.wait(60)
        return Decider(smollm2)

    with live_server(create_app(Settings(), load), ready=False) as live, live.client() as client:
        response = client.post("/v1/systemone", json=SYSTEM_ONE)
        loaded.set()
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    check(response, ErrorBody)


@pytest.mark.parametrize("path", list(ANSWERS))
def test_the_documented_example_bodies_are_answered(smollm2_server: Live, path: str) -> None:
    # The documentation page's "Try it out" sends these as they are.
    document = httpx.get(smollm2_server.url + "/openapi.json").json()
    example = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
    with smollm2_server.client() as client:
        response = client.post(path, json=example)
    assert response.status_code == 200, response.text
    check(response, ANSWERS[path])
