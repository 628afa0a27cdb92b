"""``slotread serve --upstream``: the decision server in front of two real ``slotread engine`` processes.

The gateway (in this process, uvicorn on loopback) renders the prompts and sends the reads to the
replicas (subprocesses serving the tiny DiffusionGemma in float32). Its answers must equal an
in-process Decider's, and a decision stage's reads must reach a replica in one request. Replicas
killed, stopped, broken and lost under load: tests/serve/test_faults.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotread.decider import Decider
from slotread.engines.remote.engine import RemoteEngine
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.engines.remote.replicas import Replica
from tests.serve.live import Live, live_server

QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the customer need this solved within a few days?"},
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"card_arrival": "a card they ordered has not arrived", "refund": "money back", "other": None},
    },
    "frustration": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
    "escalate": {"type": "noul", "depends_on": ["intent"], "ask_if": {"urgent": [True, False]}},
}
STATE = "My card still hasn't arrived after two weeks. Send a new one!"
#: one stage of two reads: a quick decision for the load tests
SHORT = {name: QUESTIONS[name] for name in ("urgent", "intent")}


def request(seed: int, **fields: Any) -> dict[str, Any]:
    return {"state": STATE, "questions": QUESTIONS, "x_seed": seed, **fields}


def gateway_settings(replicas: list[Replica], model: Path, **limits: Any) -> Settings:
    return Settings(
        model=str(model),
        upstreams=[replica.url for replica in replicas],
        upstream_timeout_s=10.0,
        health_interval_s=0.2,
        **limits,
    )


def gateway_decider(settings: Settings) -> Decider:
    """The Decider ``slotread serve`` builds from these settings."""
    return Decider(
        settings.model,
        upstreams=settings.upstreams,
        upstream_timeout_s=settings.upstream_timeout_s,
        health_interval_s=settings.health_interval_s,
    )


@pytest.fixture(scope="module")
def gateway(diffusion_replicas: list[Replica], tiny_diffusion_dir: Path) -> Iterator[Live]:
    settings = gateway_settings(diffusion_replicas, tiny_diffusion_dir, queue_size=64, request_deadline_s=30.0)
    with live_server(create_app(settings, gateway_decider(settings))) as live:
        yield live


def assert_close(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal structure and strings, numbers within 1e-5."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict) and list(ours) == list(theirs), where
        for key in ours:
            assert_close(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_close(a, b, f"{where}[{index}]")
    elif isinstance(ours, float):
        assert type(theirs) is float and math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-5), (
            f"{where}: {ours} {theirs}"
        )
    else:
        assert ours == theirs, where


def test_answers_equal_the_in_process_answers(gateway: Live, tiny_diffusion: LoadedModel) -> None:
    wide = {"type": "choice", "criteria": {f"option {index}": None for index in range(255)}}  # 2 bodies a read
    body = request(3, x_samples=2, questions={**QUESTIONS, "wide": wide})
    with gateway.client() as client:
        response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    in_process = Decider(tiny_diffusion, max_options=255).decide(body)
    # only an in-process engine knows whether its reads are batch-invariant (DiffusionGemma batches by default)
    assert in_process.pop("x_deterministic") is False
    assert_close(response.json(), in_process)
    assert response.json()["answers"]["escalate"] is not None


def test_a_stages_reads_reach_the_replicas_in_one_request(gateway: Live, diffusion_replicas: list[Replica]) -> None:
    """SHORT is one stage of two reads (a yes/no and a 3-option choice): one HTTP request to one replica."""

    def requests_sent() -> float:
        with gateway.client() as client:
            text = client.get("/metrics").text
        return sum(
            metric(text, "slotread_upstream_requests_total", replica.url, "ok") for replica in diffusion_replicas
        )

    before = requests_sent()
    with gateway.client() as client:
        response = client.post("/v1/systemone", json=request(5, questions=SHORT))
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == set(SHORT)
    assert requests_sent() == before + 1


def test_a_causal_model_answers_as_in_process(smollm2: LoadedModel, tmp_path: Path) -> None:
    replica = Replica(smollm2.name, tmp_path / "engine.log").start()
    try:
        replica.wait_ready()
        gateway = Decider(smollm2.name, upstreams=[replica.url], upstream_timeout_s=30.0)
        try:
            assert gateway.engine.family == "causal"
            assert isinstance(gateway.engine, RemoteEngine) and gateway.engine.slotread  # a slotread replica
            in_process = Decider(smollm2).decide(request(0))
            assert in_process.pop("x_deterministic") is True  # one row per forward, the CPU default
            assert_close(gateway.decide(request(0)), in_process)
        finally:
            gateway.close()
    finally:
        replica.stop()


def metric(text: str, name: str, replica: str, outcome: str = "") -> float:
    labels = f'outcome="{outcome}",replica="{replica}"' if outcome else f'replica="{replica}"'
    found = re.search(rf"^{name}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0
