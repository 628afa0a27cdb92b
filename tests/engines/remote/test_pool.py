"""ReplicaPool on real ``slotread engine`` servers: choice, refusals, and slow told from gone.

Faults under a gateway's load are tested through the gateway (tests/serve/test_faults.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.remote.pool import EJECTION_S, FAILED_READS, ReplicaPool
from slotread.engines.remote.wire import completion_bodies
from slotread.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from slotread.models.tiny import GEMMA4_VOCAB_SIZE
from tests.engines.remote.replicas import FailingReplica, Replica, free_port

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def body(tiny_diffusion_dir: Path) -> bytes:
    request = ReadRequest(prompt=((5, 6, 7, 8),), canvas=tuple(range(10, 26)), slots=(Slot(2, (100, 200)),), seed=1)
    [only] = completion_bodies(request, "diffusion", str(tiny_diffusion_dir), GEMMA4_VOCAB_SIZE)
    return json.dumps(only).encode()


def started(urls: list[str], health_interval_s: float = 60.0, timeout_s: float = 10.0) -> ReplicaPool:
    """A pool of ``urls``, checked once; with the default interval the test decides when the next check runs."""
    pool = ReplicaPool(urls, timeout_s=timeout_s, health_interval_s=health_interval_s)
    pool.start(admit=lambda listing: None)
    return pool


@pytest.fixture
def pool(diffusion_replicas: list[Replica]) -> Iterator[ReplicaPool]:
    pool = started([replica.url for replica in diffusion_replicas])
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def failing(diffusion_replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailingReplica]:
    replica = FailingReplica(diffusion_replicas[0], tmp_path_factory.mktemp("failing") / "failing.log")
    replica.start().wait_ready()
    yield replica
    replica.stop()


def outcomes(pool: ReplicaPool, outcome: str) -> list[int]:
    return [stats.outcomes.get(outcome, 0) for stats in pool.stats()]


def choices(answer: bytes) -> Any:
    return json.loads(answer)["choices"]


def test_reads_go_round_when_replicas_are_equally_busy(pool: ReplicaPool, body: bytes) -> None:
    answers = [pool.post_all(COMPLETIONS, [body])[0] for _ in range(4)]
    assert outcomes(pool, "ok") == [2, 2]
    assert all(choices(answer) == choices(answers[0]) for answer in answers)
    assert [choices(answer) for answer in pool.post_all(COMPLETIONS, [body] * 3)] == [choices(answers[0])] * 3


def test_a_refused_read_is_not_sent_elsewhere(pool: ReplicaPool, body: bytes) -> None:
    bad = json.dumps({**json.loads(body), "temperature": 1.0}).encode()
    with pytest.raises(UpstreamError, match=r"/v1/completions answered 400: .*temperature"):
        pool.post_all(COMPLETIONS, [bad])
    assert sum(outcomes(pool, "refused")) == 1 and sum(outcomes(pool, "ok")) == 0
    assert all(stats.up for stats in pool.stats())  # a refusal says nothing about the replica's health


def test_a_replica_nothing_listens_on_leaves_at_once_even_the_last(
    diffusion_replicas: list[Replica], body: bytes
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    pool = started([dead, diffusion_replicas[0].url])
    try:
        assert [stats.up for stats in pool.stats()] == [False, True]
        assert choices(pool.post_all(COMPLETIONS, [body])[0])
    finally:
        pool.close()
    alone = started([dead], health_interval_s=3.0)
    try:
        started_at = time.monotonic()
        with pytest.raises(UpstreamUnavailable, match="ConnectError") as caught:
            alone.post_all(COMPLETIONS, [body])
        assert time.monotonic() - started_at < 0.5  # at once: nothing is in rotation
        assert caught.value.retry_after == 3.0  # the next health check
    finally:
        alone.close()


def test_a_stopped_replica_leaves_the_rotation_and_its_reads_move(
    diffusion_replicas: list[Replica], body: bytes
) -> None:
    stopped = diffusion_replicas[1]
    pool = started([replica.url for replica in diffusion_replicas], health_interval_s=0.5)
    try:
        stopped.pause()
        try:
            sent = time.monotonic()
            answers = pool.post_all(COMPLETIONS, [body] * 4, answer_by=sent + 20.0)  # 2 go to the stopped one
            waited = time.monotonic() - sent
            assert all(choices(answer) == choices(answers[0]) for answer in answers)
            # two checks unanswered within 1 s, 0.5 s apart, after at most one interval: about 3 s, not the deadline
            assert waited < 8.0, waited
            [kept, out] = pool.stats()
            assert kept.up and not out.up and out.outcomes["moved"] >= 1
            assert "health checks went unanswered" in pool.replicas[1].reason
        finally:
            stopped.resume()
        deadline = time.monotonic() + 20.0  # the resumed process first finishes the reads it was sent
        while not pool.replicas[1].up:
            assert time.monotonic() < deadline, pool.replicas[1].reason
            time.sleep(0.2)
    finally:
        pool.close()


def test_the_last_replica_is_not_taken_out_for_being_slow(diffusion_replicas: list[Replica], body: bytes) -> None:
    slow = diffusion_replicas[1]
    pool = started([slow.url], health_interval_s=0.2)
    try:
        slow.pause()
        try:
            sent = time.monotonic()
            with pytest.raises(UpstreamTimeout, match="deadline passed") as caught:
                pool.post_all(COMPLETIONS, [body], answer_by=sent + 4.0)
            assert 4.0 <= time.monotonic() - sent < 5.0  # its deadline, not a fixed timeout
            assert caught.value.retry_after == 0.2
            assert pool.any_up  # two checks or more went unanswered meanwhile; it stayed, the last one
            assert "health checks went unanswered" in pool.replicas[0].reason
        finally:
            slow.resume()
        assert choices(pool.post_all(COMPLETIONS, [body], answer_by=time.monotonic() + 20.0)[0])
        assert pool.stats()[0].outcomes["late"] == 1
    finally:
        pool.close()


def test_a_replica_answering_500_has_its_reads_resent_then_leaves(
    failing: FailingReplica, diffusion_replicas: list[Replica], body: bytes
) -> None:
    pool = started([failing.url, diffusion_replicas[1].url])
    try:
        answers = [pool.post_all(COMPLETIONS, [body])[0] for _ in range(2 * FAILED_READS)]
        assert all(choices(answer) for answer in answers)  # each read the failing one took was resent
        [bad, good] = pool.stats()
        assert (bad.outcomes["failed"], bad.up) == (FAILED_READS, False)
        assert good.outcomes["ok"] == 2 * FAILED_READS
        assert pool.replicas[0].reason == f"{FAILED_READS} reads in a row answered 5xx, the last 500"
        pool.check()  # its health route answers, but it stays out for EJECTION_S
        assert not pool.stats()[0].up and EJECTION_S >= 5.0
    finally:
        pool.close()
    alone = started([failing.url])
    try:
        with pytest.raises(UpstreamUnavailable, match="illegal memory access"):
            alone.post_all(COMPLETIONS, [body])
        assert alone.stats()[0].outcomes["failed"] == 2  # sent once more, to the same one: the only one
    finally:
        alone.close()


def test_a_replica_serving_another_model_leaves_the_rotation(pool: ReplicaPool, body: bytes) -> None:
    """A 404 to a read: the replica was restarted with another model since it was admitted."""
    other = json.dumps({**json.loads(body), "model": "another-model"}).encode()
    with pytest.raises(UpstreamUnavailable, match="answered 404") as caught:
        pool.post_all(COMPLETIONS, [other])
    assert outcomes(pool, "refused") == [1, 1]  # each was tried: a 404 means the read never ran
    assert not pool.any_up and "another-model" in str(caught.value)
