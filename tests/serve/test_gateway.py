"""``slotread serve --upstream``: the decision server in front of two real ``slotread engine`` processes.

The gateway (in this process, uvicorn on loopback) renders the prompts and sends the reads to the
replicas (subprocesses serving the tiny DiffusionGemma in float32). Its answers must equal an
in-process Decider's; killing a replica under load must lose no request; a restarted replica must
take reads again; with no replica left, requests get a 503 with retry-after.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
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


def wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_killing_a_replica_loses_no_request_and_a_restart_rejoins(
    gateway: Live, diffusion_replicas: list[Replica]
) -> None:
    victim = diffusion_replicas[1]
    responses: list[httpx.Response] = []
    stop = threading.Event()

    def client_loop(worker: int) -> None:
        # A hang fails the test: every request is bounded by the client's timeout.
        with gateway.client(timeout=30.0) as client:
            for seed in range(worker * 10_000, (worker + 1) * 10_000):
                if stop.is_set():
                    return
                responses.append(client.post("/v1/systemone", json=request(seed, questions=SHORT)))

    def victim_metric(name: str, outcome: str = "") -> float:
        with gateway.client() as client:
            return metric(client.get("/metrics").text, name, victim.url, outcome)

    with ThreadPoolExecutor(3) as clients:
        workers = [clients.submit(client_loop, worker) for worker in range(3)]
        try:
            wait_for(lambda: len(responses) >= 6 and victim_metric("slotread_upstream_requests_total", "ok") > 0, 60)
            victim.kill()  # reads in flight there break; they must be read again on the other replica
            killed_at = len(responses)
            wait_for(lambda: len(responses) >= killed_at + 6, 60)
        finally:
            stop.set()
            for worker in workers:
                worker.result(60)
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503}, [response.text for response in responses if response.status_code != 200]
    assert all("retry-after" in response.headers for response in responses if response.status_code == 503)
    assert statuses[killed_at:].count(200) >= 6
    assert victim_metric("slotread_upstream_up") == 0.0

    before = victim_metric("slotread_upstream_requests_total", "ok")
    victim.start().wait_ready()
    with gateway.client() as client:
        wait_for(lambda: client.get("/readyz").json()["upstreams"][victim.url] == "up", 10)
        for seed in range(4):  # ties go round, so some of these reach the victim
            assert client.post("/v1/systemone", json=request(seed)).status_code == 200
    assert victim_metric("slotread_upstream_requests_total", "ok") > before


def test_with_no_replica_left_requests_get_503_with_retry_after(
    gateway: Live, diffusion_replicas: list[Replica]
) -> None:
    with gateway.client() as client:
        for replica in diffusion_replicas:
            replica.pause()
        try:
            wait_for(lambda: client.get("/readyz").status_code == 503, 10)
            readiness = client.get("/readyz").json()
            assert readiness["reason"] == "no upstream replica is in rotation"
            assert set(readiness["upstreams"].values()) == {"down"}
            started = time.monotonic()
            response = client.post("/v1/systemone", json=request(1))
            assert time.monotonic() - started < 1.0
            assert response.status_code == 503
            assert response.json()["detail"]["error_type"] == "upstream_unavailable_error"
            assert response.headers["retry-after"] == "1" and response.headers["retry-after-ms"] == "200"
        finally:
            for replica in diffusion_replicas:
                replica.resume()
        wait_for(lambda: client.get("/readyz").status_code == 200, 10)
        assert client.post("/v1/systemone", json=request(1)).status_code == 200
