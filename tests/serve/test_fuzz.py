"""Fuzz the served OpenAPI document: generated bodies, valid and not, never get a 5xx."""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.live import Live, live_server
from tests.serve.schema_strategies import JSON_VALUES, from_schema

#: the whole file stays well inside a minute on two cores
BUDGET_S = 50.0
FUZZ = settings(
    # derandomized: the draws follow the schema, so each new optional field shifts them; 150 examples (about
    # 25 s here) reach valid bodies as well as refused ones
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def fuzz_server(smollm2: LoadedModel) -> Iterator[Live]:
    # Small limits: long generated prompts are refused (413) before any read, so each example is quick.
    decider = Decider(smollm2, max_questions=3, max_prompt_tokens=400)
    with live_server(create_app(Settings(max_body_bytes=64 * 1024), decider)) as live:
        yield live


@pytest.fixture(scope="module")
def bodies(fuzz_server: Live) -> dict[str, st.SearchStrategy[Any]]:
    """Per POST route, bodies from its served schema mixed with arbitrary JSON."""
    document = httpx.get(fuzz_server.url + "/openapi.json").json()
    components = document["components"]["schemas"]
    routes = {}
    for path, item in document["paths"].items():
        if "post" in item:
            schema = item["post"]["requestBody"]["content"]["application/json"]["schema"]
            routes[path] = from_schema(schema, components) | JSON_VALUES
    assert set(routes) == {"/v1/systemone", "/v1/decisions", "/v1/chat/completions"}
    return routes


def test_generated_bodies_never_get_a_5xx(fuzz_server: Live, bodies: dict[str, st.SearchStrategy[Any]]) -> None:
    started = time.monotonic()
    statuses: set[int] = set()
    with fuzz_server.client() as client:

        @FUZZ
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            if time.monotonic() - started > BUDGET_S:
                return
            path = data.draw(st.sampled_from(sorted(bodies)))
            body = data.draw(bodies[path])
            response = client.post(path, json=body)
            statuses.add(response.status_code)
            assert response.status_code < 500, (path, body, response.text)
            assert response.headers["x-typesafe-request-id"]

        check()
    assert 200 in statuses and 422 in statuses


def test_arbitrary_bytes_and_encodings_never_get_a_5xx(fuzz_server: Live) -> None:
    encoders = {
        "": bytes,
        "identity": bytes,
        "gzip": gzip.compress,
        "zstd": zstandard.ZstdCompressor().compress,
        "br": bytes,
    }
    with fuzz_server.client() as client:

        @FUZZ
        @given(raw=st.binary(max_size=2000), encoding=st.sampled_from(sorted(encoders)), encode=st.booleans())
        def check(raw: bytes, encoding: str, encode: bool) -> None:
            content = encoders[encoding](raw) if encode else raw
            for path in ("/v1/systemone", "/v1/decisions"):
                response = client.post(
                    path, content=content, headers={"content-encoding": encoding} if encoding else {}
                )
                assert response.status_code < 500, (path, encoding, raw[:100], response.text)

        check()
