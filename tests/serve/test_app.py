"""``/v1/systemone`` and the operations routes on the real server (uvicorn, loopback, SmolLM2-135M)."""

from __future__ import annotations

import gzip
import json
import math
from typing import Any

import httpx
import pytest
import zstandard

from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.live import Live, live_server

HEADER = "x-typesafe-request-id"

QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the customer need this solved within a few days?"},
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"card_arrival": "a card they ordered has not arrived", "refund": "money back", "other": None},
    },
    "frustration": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["calm", {"level": "annoyed"}, "furious"],
    },
}
REQUEST = {"state": "My card still hasn't arrived after two weeks. Send a new one!", "questions": QUESTIONS}


def strict_json(response: httpx.Response) -> Any:
    """The body as JSON, failing on NaN or Infinity (which are not JSON)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the response body")

    return json.loads(response.text, parse_constant=refuse)


def check_answers(body: dict[str, Any]) -> None:
    """Every answer shape of DESIGN.md section 5, with its formulas."""
    answers = body["answers"]
    assert list(answers) == ["urgent", "intent", "frustration"]
    noul = answers["urgent"]
    assert noul["type"] == "noul" and type(noul["noul"]) is float and 0 <= noul["noul"] <= 1
    assert "confidence" not in noul
    choice = answers["intent"]
    p = choice["probabilities"]
    assert list(p) == ["card_arrival", "refund", "other"] and math.isclose(sum(p.values()), 1.0, abs_tol=1e-9)
    assert choice["choice"] == max(p, key=p.__getitem__)
    assert math.isclose(choice["confidence"], (max(p.values()) - 1 / 3) / (2 / 3), abs_tol=1e-9)
    score = answers["frustration"]
    assert score["legend"] == {"0": "calm", "1": {"level": "annoyed"}, "2": "furious"}
    levels = [score["probabilities"][str(i)] for i in range(3)]
    assert math.isclose(sum(levels), 1.0, abs_tol=1e-9)
    assert math.isclose(score["score"], sum(i * q for i, q in enumerate(levels)), abs_tol=1e-9)
    top = max(range(3), key=levels.__getitem__)
    spread = sum(abs(i - 1) for i in range(3)) / 3
    expected = max(0.0, 1 - sum(q * abs(i - top) for i, q in enumerate(levels)) / spread)
    assert math.isclose(score["confidence"], expected, abs_tol=1e-9)
    for answer in answers.values():
        assert {"x_entropy", "x_label_mass", "x_reads"} <= set(answer)
    usage = body["usage"]
    assert type(usage["input_tokens"]) is int and type(usage["output_tokens"]) is int and usage["output_tokens"] == 3


def test_every_answer_type(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 200, response.text
    body = strict_json(response)
    assert body["model"] == "smollm2-135m-instruct"
    check_answers(body)
    assert response.headers[HEADER].startswith("req_")


def test_a_thinking_decision_through_the_server(smollm2_server: Live) -> None:
    """x_think through the server's batching engine: each answer returns its thought, usage counts it."""
    with smollm2_server.client() as client:
        response = client.post("/v1/systemone", json={**REQUEST, "x_think": 6, "x_thought": True})
    assert response.status_code == 200, response.text
    body = strict_json(response)
    check_answers({**body, "usage": {**body["usage"], "output_tokens": 3}})
    thoughts = [answer["x_thought"] for answer in body["answers"].values()]
    assert all(isinstance(thought, str) for thought in thoughts)
    assert 3 < body["usage"]["output_tokens"] <= 3 + 3 * 6


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_compressed_bodies_give_the_same_answers(smollm2_server: Live, encoding: str) -> None:
    raw = json.dumps({**REQUEST, "padding": "x" * 2000}).encode()
    compressed = zstandard.ZstdCompressor().compress(raw) if encoding == "zstd" else gzip.compress(raw)
    with smollm2_server.client() as client:
        plain = client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
        packed = client.post(
            "/v1/systemone",
            content=compressed,
            headers={"content-type": "application/json", "content-encoding": encoding},
        )
    assert packed.status_code == 200, packed.text
    assert strict_json(packed)["answers"] == strict_json(plain)["answers"]


def test_model_names_vllm_fields_and_unknown_fields(smollm2_server: Live) -> None:
    extras = {
        "instructions": {"role": "support triage"},
        "cache_salt": "tenant-7",
        "priority": -3,
        "joint": False,
        "unknown_field": [1, 2],
    }
    with smollm2_server.client() as client:
        for model in ("smollm2-135m-instruct", "jev-latest", None):
            body = {**REQUEST, **extras, **({"model": model} if model else {})}
            response = client.post("/v1/systemone", json=body)
            assert response.status_code == 200, response.text
        unknown = client.post("/v1/systemone", json={**REQUEST, "model": "gpt-9"})
    assert unknown.status_code == 404
    detail = strict_json(unknown)["detail"]
    assert detail["error_type"] == "not_found_error" and "gpt-9" in detail["message"]


def test_the_client_request_id_is_echoed_when_it_is_safe(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        echoed = client.post("/v1/systemone", json={**REQUEST, "request_id": "client-42"})
        unsafe = client.post("/v1/systemone", json={**REQUEST, "request_id": "two words\r\nx-evil: 1"})
    assert echoed.headers[HEADER] == "client-42"
    assert unsafe.status_code == 200 and unsafe.headers[HEADER].startswith("req_") and "x-evil" not in unsafe.headers


CHOICE = {"type": "choice", "criteria": {"a": None, "b": None}}


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"questions": {"q": {"type": "noul"}}}, ["body", "state"]),
        ({"state": "s"}, ["body", "questions"]),
        ({"state": "s", "questions": {}}, ["body", "questions"]),
        ({"state": "s", "questions": {"q": {"type": "box"}}}, ["body", "questions", "q"]),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": None}}}},
            ["body", "questions", "q", "choice", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
            ["body", "questions", "q", "score", "criteria"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}}}},
            ["body", "questions", "q", "noul", "criteria", "maybe"],
        ),
        ({"state": "s", "questions": {"q": CHOICE}, "x_samples": 0}, ["body", "x_samples"]),
        ({"state": "s", "questions": {"q": CHOICE}, "x_seed": "7"}, ["body", "x_seed"]),
        ({"state": "s", "questions": {"q": CHOICE}, "priority": "high"}, ["body", "priority"]),
        (
            {"state": "s", "questions": {"q": {**CHOICE, "depends_on": "later"}}},
            ["body", "questions", "q", "depends_on", 0],
        ),
        ([1, 2], ["body"]),
    ],
)
def test_validation_errors_are_422_with_located_detail(smollm2_server: Live, body: Any, loc: list[Any]) -> None:
    with smollm2_server.client() as client:
        response = client.post("/v1/systemone", json=body)
    assert response.status_code == 422, response.text
    detail = strict_json(response)["detail"]
    assert all(set(d) == {"loc", "msg", "type"} and d["loc"][0] == "body" for d in detail)
    assert loc in [d["loc"] for d in detail]
    assert response.headers[HEADER]


def test_malformed_json_is_a_422(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        response = client.post(
            "/v1/systemone", content=b'{"state": "s", "questions": ', headers={"content-type": "application/json"}
        )
    assert response.status_code == 422
    assert strict_json(response)["detail"][0]["type"] == "json_invalid"


def test_oversized_bodies_and_prompts_are_413(smollm2_server: Live) -> None:
    bomb = zstandard.ZstdCompressor().compress(b'{"state": "' + b" " * 20_000_000 + b'"}')
    long_state = " ".join(["word"] * 10_000)  # more tokens than SmolLM2's 8,192 positions
    with smollm2_server.client() as client:
        plain = client.post("/v1/systemone", content=b"{" + b" " * 2_000_000 + b"}")
        zipped = client.post("/v1/systemone", content=bomb, headers={"content-encoding": "zstd"})
        prompt = client.post("/v1/systemone", json={"state": long_state, "questions": {"q": {"type": "noul"}}})
    for response in (plain, zipped, prompt):
        assert response.status_code == 413, response.text
        assert strict_json(response)["detail"]["error_type"] == "request_too_large"
        assert response.headers[HEADER]


def test_an_unknown_content_encoding_is_415(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        response = client.post("/v1/systemone", content=b"{}", headers={"content-encoding": "br"})
    assert response.status_code == 415
    assert strict_json(response)["detail"]["error_type"] == "unsupported_media_type"


def test_models_health_readiness_docs_and_metrics(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        assert client.post("/v1/systemone", json=REQUEST).status_code == 200
        models = client.get("/v1/models")
        paths = ("/healthz", "/readyz", "/openapi.json", "/docs", "/static-offline-docs/swagger-ui.css", "/metrics")
        responses = {path: client.get(path) for path in paths}
        missing, wrong_method = client.get("/v1/nothing"), client.get("/v1/systemone")
    assert models.status_code == 200
    listed = strict_json(models)["models"]
    assert [m["name"] for m in listed] == ["smollm2-135m-instruct", "jev-latest"]
    assert all(
        set(m) == {"name", "description", "release_date", "x_images"} and len(m["release_date"]) == 10 for m in listed
    )
    assert not any(m["x_images"] for m in listed)  # a text-only model
    assert all(r.status_code == 200 for r in responses.values())
    assert responses["/readyz"].json() == {"status": "ready", "model": "smollm2-135m-instruct"}
    document = responses["/openapi.json"].json()
    assert {"/v1/systemone", "/v1/decisions", "/v1/models"} <= set(document["paths"])
    body_schema = document["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema["$ref"].split("/")[-1] in document["components"]["schemas"]
    assert (
        'route="/v1/systemone"' in responses["/metrics"].text and "slotread_queue_depth" in responses["/metrics"].text
    )
    # Starlette's plain routes and mounts (the document, the pages' assets) are labelled by path too; only
    # unknown paths are "unmatched".
    for route in ("/openapi.json", "/docs", "/static-offline-docs"):
        assert f'route="{route}",status="200"' in responses["/metrics"].text
    for response in (missing, wrong_method):
        assert response.status_code in (404, 405)
        assert set(strict_json(response)["detail"]) == {"error_type", "message"}
    for response in [models, missing, wrong_method, *responses.values()]:
        assert response.headers[HEADER]


def test_metrics_count_the_engines_work(tiny_diffusion: LoadedModel) -> None:
    """The engine's counters and the process's CPU time are exported for the benchmarks."""
    with live_server(create_app(Settings(), Decider(tiny_diffusion))) as live, live.client() as client:
        assert client.post("/v1/systemone", json=REQUEST).status_code == 200
        text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["slotread_engine_prompt_tokens_total"] > 0 and values["slotread_engine_canvas_tokens_total"] > 0
    assert values["slotread_engine_prefix_cache_misses_total"] > 0
    assert values["slotread_engine_graph_captures_total"] == 0  # no CUDA here
    assert values["slotread_engine_batches_total"] >= 1 and values["slotread_engine_busy_seconds_total"] > 0
    assert values["process_cpu_seconds_total"] > 0


def test_an_engine_fault_is_a_500_that_says_so(smollm2: LoadedModel) -> None:
    from tests.core.test_decide import NanEngine

    decider = Decider(smollm2)
    decider.engine = NanEngine(decider.engine)
    with live_server(create_app(Settings(), decider)) as live, live.client() as client:
        response = client.post("/v1/systemone", json=REQUEST)
        after = client.get("/healthz")  # the connection and the server carry on
    assert response.status_code == 500 and after.status_code == 200
    detail = response.json()["detail"]
    assert detail["error_type"] == "engine_error" and "non-finite label logits" in detail["message"]
