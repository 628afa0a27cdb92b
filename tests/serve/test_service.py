"""Overload, deadlines, disconnects, shutdown, loading and bugs, on the real server with a held engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotread.decider import Decider
from slotread.engines.base import ReadRequest, SlotScores
from slotread.errors import ModelLoadError
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.serve.service import DecisionService
from slotread.settings import Settings
from tests.engines.remote.replicas import Replica
from tests.serve.live import Live, ThreadsSeen, held_decider, live_server

REQUEST = {"state": "the server is down", "questions": {"urgent": {"type": "noul"}}}
HEADER = "x-typesafe-request-id"


def post(live: Live, body: Any = REQUEST, timeout: float = 60.0) -> httpx.Response:
    with live.client(timeout=timeout) as client:
        return client.post("/v1/systemone", json=body)


def service_of(live: Live) -> DecisionService:
    service = live.app.state.service
    assert isinstance(service, DecisionService)
    return service


def wait_for(condition: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_full_queue_answers_529_at_once_and_a_late_waiter_529_at_its_deadline(smollm2: LoadedModel) -> None:
    decider, held = held_decider(smollm2)
    settings = Settings(max_concurrency=1, queue_size=1, request_deadline_s=1.0, retry_after_s=2.5)
    with live_server(create_app(settings, decider)) as live, ThreadPoolExecutor(4) as pool:
        gate = service_of(live).gate
        running: Future[httpx.Response] = pool.submit(post, live)
        assert held.entered.wait(30)
        queued = pool.submit(post, live)
        wait_for(lambda: gate.waiting == 1)
        started = time.monotonic()
        refused = post(live)
        assert time.monotonic() - started < 1.0  # at once, not after the deadline
        assert refused.status_code == 529
        assert refused.json()["detail"]["error_type"] == "overloaded_error"
        assert (refused.headers["retry-after"], refused.headers["retry-after-ms"]) == ("3", "2500")
        assert refused.headers[HEADER]
        timed_out = queued.result(30)  # waited its 1 s deadline behind the held read
        assert timed_out.status_code == 529 and timed_out.headers["retry-after"] == "3"
        held.release.set()
        assert running.result(30).status_code == 200
        assert post(live).status_code == 200
        assert (gate.running, gate.waiting) == (0, 0)
        metrics = httpx.get(live.url + "/metrics").text
    assert 'slotread_requests_total{route="/v1/systemone",status="529"} 2.0' in metrics


def test_a_client_that_leaves_the_queue_frees_its_place(smollm2: LoadedModel) -> None:
    decider, held = held_decider(smollm2)
    settings = Settings(max_concurrency=1, queue_size=1, request_deadline_s=30.0)
    with live_server(create_app(settings, decider)) as live, ThreadPoolExecutor(2) as pool:
        gate = service_of(live).gate
        running = pool.submit(post, live)
        assert held.entered.wait(30)
        with pytest.raises(httpx.ReadTimeout):
            post(live, timeout=0.5)  # queued, then gone
        wait_for(lambda: gate.waiting == 0, seconds=5.0)  # long before its 30 s deadline
        queued = pool.submit(post, live)  # the place it held is free again
        wait_for(lambda: gate.waiting == 1)
        held.release.set()
        assert running.result(30).status_code == 200 and queued.result(30).status_code == 200


def test_shutdown_drains_the_decisions_in_flight(smollm2: LoadedModel) -> None:
    decider, held = held_decider(smollm2)
    with live_server(create_app(Settings(), decider)) as live, ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, live)
        assert held.entered.wait(30)
        live.server.should_exit = True
        time.sleep(0.3)
        held.release.set()
        response = running.result(30)
    assert response.status_code == 200 and response.json()["answers"]["urgent"]["type"] == "noul"


class BrokenEngine:
    """An engine with a bug: every read raises."""

    family = "causal"
    noisy = False
    deterministic = False
    max_tokens = 8192

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        raise RuntimeError("a bug in the engine")


def test_a_bug_is_a_plain_500_with_a_request_id(smollm2: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    decider = Decider(smollm2)
    decider.engine = BrokenEngine()
    with live_server(create_app(Settings(), decider)) as live:
        response = post(live)
    assert response.status_code == 500
    assert response.text == "Internal Server Error" and response.headers[HEADER]


def test_readiness_follows_the_model_load(smollm2: LoadedModel) -> None:
    loaded = threading.Event()

    def load() -> Decider:
        assert loaded.wait(60)
        return Decider(smollm2)

    with live_server(create_app(Settings(), load), ready=False) as live, live.client() as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        early = client.post("/v1/systemone", json=REQUEST)
        assert early.status_code == 503 and "retry-after" in early.headers
        assert early.json()["detail"]["error_type"] == "not_ready_error"
        loaded.set()
        wait_for(lambda: client.get("/readyz").status_code == 200)
        assert client.post("/v1/systemone", json=REQUEST).status_code == 200


def test_the_warm_up_and_the_decisions_read_in_one_thread(smollm2: LoadedModel) -> None:
    """A loaded model's warm-up read runs in the batcher's engine thread, as every decision's does."""
    seen: list[ThreadsSeen] = []

    def load() -> Decider:
        decider = Decider(smollm2)
        seen.append(ThreadsSeen(decider.engine))
        decider.engine = seen[0]
        return decider

    with live_server(create_app(Settings(max_concurrency=4), load)) as live:
        warm_up = len(seen[0].threads)
        with ThreadPoolExecutor(4) as pool:
            assert all(response.status_code == 200 for response in pool.map(lambda _: post(live), range(8)))
    assert warm_up >= 1 and len(seen[0].threads) > warm_up and len(set(seen[0].threads)) == 1


def test_a_model_that_fails_to_load_keeps_the_server_unready_and_says_why() -> None:
    def load() -> Decider:
        raise ModelLoadError("no-such-model", "not in the registry")

    with live_server(create_app(Settings(), load), ready=False) as live, live.client() as client:
        wait_for(lambda: "failed" in client.get("/readyz").text)
        response = client.get("/readyz")
    assert response.status_code == 503 and "no-such-model" in response.json()["reason"]


def test_a_gateway_whose_replicas_fail_the_warm_up_still_serves_when_they_return(
    smollm2: LoadedModel, tmp_path: Path
) -> None:
    # a timeout far below a read's time fails the warm-up decision (it has no request deadline), as a
    # replica still compiling its kernels may: the gateway must not stay unready for it
    replica = Replica(smollm2.name, tmp_path / "engine.log").start()
    try:
        replica.wait_ready()

        def load() -> Decider:
            return Decider(smollm2.name, upstreams=[replica.url], upstream_timeout_s=0.001, health_interval_s=0.2)

        with live_server(create_app(Settings(), load), ready=False) as live, live.client() as client:
            wait_for(lambda: client.get("/readyz").status_code == 200, seconds=60)
            assert service_of(live).load_error is None
            remote = service_of(live).upstreams
            assert remote is not None and "late" in remote.pool.stats()[0].outcomes  # the warm-up's read
            # a request's reads wait until its deadline, not the timeout for reads outside requests
            assert client.post("/v1/systemone", json=REQUEST).status_code == 200
    finally:
        replica.stop()
