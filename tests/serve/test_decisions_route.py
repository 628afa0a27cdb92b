"""``/v1/decisions`` on the real server (SmolLM2-135M)."""

from __future__ import annotations

import math

from tests.serve.live import Live


def test_every_question_type_is_answered_in_order(smollm2_server: Live) -> None:
    body = {
        "input": [{"role": "user", "content": "My card was charged twice for one order."}],
        "questions": [
            {"type": "predicate", "name": "billing", "instructions": "The message is about billing."},
            {
                "type": "choice",
                "name": "tone",
                "choices": [{"value": "calm"}, {"value": "angry", "description": "upset"}],
            },
            {"type": "score", "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}]},
        ],
    }
    with smollm2_server.client() as client:
        response = client.post("/v1/decisions", json=body)
    assert response.status_code == 200, response.text
    decision = response.json()
    predicate, choice, score = decision["answers"]
    assert (predicate["type"], predicate["name"]) == ("predicate", "billing")
    assert 0 <= predicate["probability"] <= 1
    assert math.isclose(predicate["confidence"], abs(2 * predicate["probability"] - 1), abs_tol=1e-9)
    assert [p["value"] for p in choice["probabilities"]] == ["calm", "angry"]
    assert math.isclose(sum(p["probability"] for p in choice["probabilities"]), 1.0, abs_tol=1e-9)
    assert choice["choice"] == max(choice["probabilities"], key=lambda p: p["probability"])["value"]
    assert score["name"] is None and [p["value"] for p in score["probabilities"]] == [0, 1, 2]
    usage = decision["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] and usage["output_tokens"] == 3
    assert response.headers["x-typesafe-request-id"]


def test_invalid_decisions_are_422_located_in_the_decisions_body(smollm2_server: Live) -> None:
    body = {"input": "x", "questions": [{"type": "choice", "choices": [{"value": "a"}]}]}
    with smollm2_server.client() as client:
        response = client.post("/v1/decisions", json=body)
        unknown = client.post(
            "/v1/decisions", json={"model": "other", "input": "x", "questions": [{"type": "predicate"}]}
        )
    assert response.status_code == 422
    assert ["body", "questions", 0, "choice", "choices"] in [d["loc"] for d in response.json()["detail"]]
    assert unknown.status_code == 404
