"""ReplicaPool on real ``slotread engine`` servers: choice, refusals, timeouts and health checks.

Killing a replica under load, and restarting it, is tested through the gateway (tests/serve/test_gateway.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.remote.pool import ReplicaPool
from slotread.engines.remote.wire import completion_bodies
from slotread.errors import UpstreamError, UpstreamUnavailable
from slotread.models.tiny import GEMMA4_VOCAB_SIZE
from tests.engines.remote.replicas import Replica

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def body(tiny_diffusion_dir: Path) -> dict[str, Any]:
    request = ReadRequest(prompt=((5, 6, 7, 8),), canvas=tuple(range(10, 26)), slots=(Slot(2, (100, 200)),), seed=1)
    [only] = completion_bodies(request, "diffusion", str(tiny_diffusion_dir), GEMMA4_VOCAB_SIZE)
    return only


@pytest.fixture
def pool(diffusion_replicas: list[Replica]) -> Iterator[ReplicaPool]:
    # Health checks far apart, so the test decides when one runs (pool.check()).
    pool = ReplicaPool([replica.url for replica in diffusion_replicas], timeout_s=1.0, health_interval_s=60.0)
    pool.start(admit=lambda listing: None)
    yield pool
    pool.close()


def outcomes(pool: ReplicaPool, outcome: str) -> list[int]:
    return [stats.outcomes.get(outcome, 0) for stats in pool.stats()]


def test_requests_go_round_when_replicas_are_equally_busy(pool: ReplicaPool, body: dict[str, Any]) -> None:
    answers = [pool.post(COMPLETIONS, body) for _ in range(4)]
    assert outcomes(pool, "ok") == [2, 2]
    assert all(answer["choices"] == answers[0]["choices"] for answer in answers)


def test_a_refused_request_is_not_tried_elsewhere(pool: ReplicaPool, body: dict[str, Any]) -> None:
    with pytest.raises(UpstreamError, match=r"/v1/completions answered 400: .*temperature"):
        pool.post(COMPLETIONS, {**body, "temperature": 1.0})
    assert sum(outcomes(pool, "refused")) == 1 and sum(outcomes(pool, "ok")) == 0
    assert all(stats.up for stats in pool.stats())  # a refusal says nothing about the replica's health


def test_a_hung_replica_times_out_leaves_the_rotation_and_comes_back(
    diffusion_replicas: list[Replica], body: dict[str, Any]
) -> None:
    hung = diffusion_replicas[1]
    pool = ReplicaPool([hung.url], timeout_s=1.0, health_interval_s=60.0)
    pool.start(admit=lambda listing: None)
    try:
        hung.pause()
        started = time.monotonic()
        with pytest.raises(UpstreamUnavailable, match="ReadTimeout") as caught:
            pool.post(COMPLETIONS, body)
        assert 1.0 <= time.monotonic() - started < 5.0  # the 1 s timeout, not the 60 s health interval
        assert caught.value.retry_after == 60.0  # the next health check
        assert not pool.any_up
        started = time.monotonic()
        with pytest.raises(UpstreamUnavailable, match="no upstream replica could take the read"):
            pool.post(COMPLETIONS, body)
        assert time.monotonic() - started < 0.1  # at once: nothing is in rotation
        pool.check()
        assert not pool.any_up  # still hung
    finally:
        hung.resume()
    try:
        # the resumed process first finishes the read it was sent while paused; on a loaded machine a
        # check may time out meanwhile, so it is back within a few checks
        deadline = time.monotonic() + 20.0
        pool.check()
        while not pool.any_up and time.monotonic() < deadline:
            time.sleep(0.5)
            pool.check()
        assert pool.any_up
        assert pool.post(COMPLETIONS, body)["choices"]
    finally:
        pool.close()
