"""Faults under load: a gateway (``slotread serve --upstream``) in front of two real ``slotread engine``
processes of SmolLM2, and an in-process server whose engine runs in a process of its own, with clients
posting decisions while replicas are killed, stopped, broken, swapped for another model, all lost, and
the engine process killed.

Every case asserts what a client must always get: a 200, or a clean 503/529 that carries retry-after;
never another status, never a connection dropped without an answer, never an answer later than the
server's deadline (the default 8 s, plus a margin for the client's own side). Then it counts: the share
answered, and what the gateway did with the replica. Each case is bounded by its clients' timeouts and
its waits. The replicas are the module's; each case leaves both running.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotread.decider import Decider
from slotread.engines.remote.pool import FAILED_READS
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.engines.remote.replicas import FailingReplica, Replica, started_replicas
from tests.serve.live import Live, live_server
from tests.serve.test_gateway import QUESTIONS as GATEWAY_QUESTIONS

MODEL = "smollm2-135m-instruct"
QUESTIONS = {name: GATEWAY_QUESTIONS[name] for name in ("urgent", "intent")}
DEADLINE_S = Settings().request_deadline_s
#: the client's side of an answer's time (connecting, sending, reading) on a busy 2-core machine
MARGIN_S = 2.0


@dataclass(frozen=True)
class Answer:
    """What one request got: its status (or how it failed without one), and when."""

    status: int | str
    retry_after: bool
    error_type: str | None
    sent: float
    seconds: float


@dataclass
class Load:
    """``clients`` threads posting decisions to ``url`` back to back, from ``__enter__`` to ``__exit__``."""

    url: str
    clients: int
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(index,)) for index in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def wait(self, count: int, seconds: float = 120.0) -> None:
        """Until ``count`` requests have been answered."""
        wait_for(lambda: len(self.answers) >= count, seconds)

    def _client(self, index: int) -> None:
        # A try is given the deadline and more: one past the deadline shows as an answer too late.
        with httpx.Client(base_url=self.url, timeout=DEADLINE_S + 10.0) as client:
            for number in range(10_000):
                if self._stop.is_set():
                    return
                body = {"state": f"Ticket {index}-{number}: my card still hasn't arrived.", "questions": QUESTIONS}
                sent = time.monotonic()
                try:
                    response = client.post("/v1/systemone", json=body)
                except httpx.HTTPError as exc:
                    self.answers.append(Answer(type(exc).__name__, False, None, sent, time.monotonic() - sent))
                    continue
                detail = response.json().get("detail") if response.status_code != 200 else None
                error_type = detail.get("error_type") if isinstance(detail, dict) else None
                answer = Answer(
                    response.status_code, "retry-after" in response.headers, error_type, sent, time.monotonic() - sent
                )
                self.answers.append(answer)
                if response.status_code in (503, 529):  # as the SDK does, wait what retry-after says
                    self._stop.wait(float(response.headers.get("retry-after-ms", 1000)) / 1000)


def wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def assert_clean(answers: list[Answer]) -> None:
    """Every answer a 200 or a 503/529 with retry-after, none later than the deadline (the counts are
    printed: ``pytest -s`` shows them)."""
    statuses = collections.Counter(str(a.status) for a in answers)
    slowest = max((a.seconds for a in answers), default=0.0)
    print(f"{len(answers)} requests: {dict(sorted(statuses.items()))}, the slowest answered in {slowest:.1f} s")
    unclean = [a for a in answers if a.status not in (200, 503, 529) or (a.status != 200 and not a.retry_after)]
    assert not unclean, unclean
    late = [a for a in answers if a.seconds > DEADLINE_S + MARGIN_S]
    assert not late, late


def ok(answers: list[Answer]) -> int:
    return sum(a.status == 200 for a in answers)


@pytest.fixture(scope="module")
def replicas(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two replicas of SmolLM2 (fetched by the ``smollm2`` fixture); each case leaves both running."""
    with started_replicas(MODEL, tmp_path_factory.mktemp("fault-replicas")) as replicas:
        yield replicas


def running_again(replica: Replica) -> None:
    """Start ``replica`` again, serving SmolLM2, unless it runs so already."""
    if replica.process is not None and replica.process.poll() is None and replica.model == MODEL:
        return
    if replica.process is not None and replica.process.poll() is None:
        replica.kill()
    replica.model = MODEL
    replica.start().wait_ready()


@contextmanager
def gateway(urls: list[str], **changed: Any) -> Iterator[Live]:
    """``slotread serve --upstream`` for ``urls``, with the server's defaults but ``changed``."""
    settings = Settings(model=MODEL, upstreams=urls, **changed)
    with live_server(create_app(settings, Decider.from_settings(settings))) as live:
        yield live


def rotation(live: Live) -> dict[str, str]:
    with live.client() as client:
        upstreams: dict[str, str] = client.get("/readyz").json()["upstreams"]
        return upstreams


def sent(live: Live, replica: Replica, outcome: str) -> float:
    """How many of the gateway's requests to ``replica`` ended with ``outcome`` (its /metrics)."""
    with live.client() as client:
        text = client.get("/metrics").text
    labels = f'outcome="{outcome}",replica="{replica.url}"'
    found = re.search(rf"^slotread_upstream_requests_total{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_replica_killed_under_load_loses_no_request_and_rejoins_when_restarted(replicas: list[Replica]) -> None:
    victim = replicas[1]
    try:
        with gateway([replica.url for replica in replicas]) as live:
            with Load(live.url, clients=4) as load:
                wait_for(lambda: len(load.answers) >= 8 and sent(live, victim, "ok") > 0, 120)
                victim.kill()  # reads in flight there break: they are sent again to the other replica
                killed = len(load.answers)
                load.wait(killed + 24)
            assert_clean(load.answers)
            assert ok(load.answers) >= 0.98 * len(load.answers), [a for a in load.answers if a.status != 200]
            assert rotation(live)[victim.url] == "down"

            before = sent(live, victim, "ok")
            victim.start().wait_ready()
            wait_for(lambda: rotation(live)[victim.url] == "up", 10)
            with Load(live.url, clients=2) as load:
                wait_for(lambda: sent(live, victim, "ok") > before, 60)
            assert_clean(load.answers)
    finally:
        running_again(victim)


def test_a_replica_stopped_for_10_s_leaves_the_rotation_its_reads_move_and_it_returns(
    replicas: list[Replica],
) -> None:
    victim = replicas[1]
    try:
        with gateway([replica.url for replica in replicas]) as live:
            with Load(live.url, clients=4) as load:
                wait_for(lambda: len(load.answers) >= 8 and sent(live, victim, "ok") > 0, 120)
                victim.pause()
                stopped = time.monotonic()
                wait_for(lambda: rotation(live)[victim.url] == "down", 10)  # two checks unanswered: about 3 s
                time.sleep(max(0.0, stopped + 10.0 - time.monotonic()))
                victim.resume()
                wait_for(lambda: rotation(live)[victim.url] == "up", 20)
                back = len(load.answers)
                load.wait(back + 8)
            assert_clean(load.answers)
            assert ok(load.answers) >= 0.95 * len(load.answers), [a for a in load.answers if a.status != 200]
            assert sent(live, victim, "moved") >= 1  # reads that waited on it went to the other replica
    finally:
        victim.resume()
        running_again(victim)


def test_a_lone_replica_that_stops_answering_is_waited_for_until_the_deadline_then_529(
    replicas: list[Replica],
) -> None:
    """Slow and stopped look alike from outside; the last replica is kept, and the decision is refused
    as load (529) when its deadline passes, not as an outage (503) before it."""
    slow = replicas[1]
    try:
        with gateway([slow.url], request_deadline_s=3.0) as live, live.client() as client:
            assert client.post("/v1/systemone", json={"state": "Card?", "questions": QUESTIONS}).status_code == 200
            slow.pause()
            started = time.monotonic()
            response = client.post("/v1/systemone", json={"state": "Where is my card?", "questions": QUESTIONS})
            assert 3.0 <= time.monotonic() - started < 3.0 + MARGIN_S
            assert response.status_code == 529 and "retry-after" in response.headers
            assert response.json()["detail"]["error_type"] == "overloaded_error"
            assert "deadline passed" in response.json()["detail"]["message"]
            assert rotation(live)[slow.url] == "up"  # its health checks went unanswered: kept, the last one
            assert sent(live, slow, "late") >= 1
            slow.resume()
            wait_for(
                lambda: client.post("/v1/systemone", json={"state": "Hi", "questions": QUESTIONS}).status_code == 200,
                30,
            )
    finally:
        slow.resume()


def test_a_replica_answering_500_has_its_reads_resent_and_leaves(replicas: list[Replica], tmp_path: Path) -> None:
    failing = FailingReplica(replicas[0], tmp_path / "failing.log").start().wait_ready()
    try:
        with gateway([failing.url, replicas[1].url]) as live:
            with Load(live.url, clients=4) as load:
                load.wait(24)
            assert_clean(load.answers)
            assert ok(load.answers) == len(load.answers)  # each read the failing replica took was resent
            assert sent(live, replicas[1], "ok") == len(load.answers)
            failed = sent(live, failing, "failed")
            # out after FAILED_READS in a row (and for EJECTION_S), not tried first by every other read
            assert FAILED_READS <= failed < len(load.answers) / 2
    finally:
        failing.stop()


def test_a_replica_restarted_with_another_model_is_kept_out(replicas: list[Replica], tiny_diffusion_dir: Path) -> None:
    victim = replicas[1]
    try:
        with gateway([replica.url for replica in replicas]) as live:
            with Load(live.url, clients=4) as load:
                load.wait(6)
                victim.kill()
                victim.model = str(tiny_diffusion_dir)
                victim.start().wait_ready()
                restarted = len(load.answers)
                load.wait(restarted + 16)
                time.sleep(2 * Settings().health_interval_s)  # checks that find it listening, on another model
            assert_clean(load.answers)
            assert ok(load.answers) >= 0.98 * len(load.answers), [a for a in load.answers if a.status != 200]
            assert rotation(live)[victim.url] == "down"
            pool = live.app.state.service.upstreams.pool
            assert f"not '{MODEL}'" in pool.replicas[1].reason
    finally:
        running_again(victim)


def test_with_every_replica_down_requests_get_503_at_once_until_one_is_back(replicas: list[Replica]) -> None:
    try:
        with gateway([replica.url for replica in replicas]) as live:
            with Load(live.url, clients=2) as load:
                load.wait(4)
                for replica in replicas:
                    replica.kill()
                with live.client() as client:
                    wait_for(lambda: client.get("/readyz").status_code == 503, 10)
                    assert client.get("/readyz").json()["reason"] == "no upstream replica is in rotation"
                    started = time.monotonic()
                    response = client.post("/v1/systemone", json={"state": "Card?", "questions": QUESTIONS})
                    assert time.monotonic() - started < 1.0
                    assert response.status_code == 503
                    assert response.json()["detail"]["error_type"] == "upstream_unavailable_error"
                    assert response.headers["retry-after"] == "2" and response.headers["retry-after-ms"] == "2000"
                    down = len(load.answers)
                    replicas[0].start().wait_ready()
                    wait_for(lambda: client.get("/readyz").status_code == 200, 10)
                back = len(load.answers)
                wait_for(lambda: ok(load.answers[back:]) >= 4, 60)
            assert_clean(load.answers)
            assert {a.error_type for a in load.answers[down:back] if a.status != 200} <= {"upstream_unavailable_error"}
    finally:
        for replica in replicas:
            running_again(replica)


def test_a_servers_engine_process_killed_under_load_answers_503_not_a_hang(smollm2: LoadedModel) -> None:
    decider = Decider(MODEL, engine_process=True)
    process = decider.engine_process
    assert process is not None
    with live_server(create_app(Settings(), decider)) as live, Load(live.url, clients=3) as load:
        load.wait(4)
        os.kill(process.pid, signal.SIGKILL)
        wait_for(lambda: process.exit_code is not None, 30)
        killed = len(load.answers)
        load.wait(killed + 6)
        with live.client() as client:
            assert client.get("/readyz").status_code == 503
    assert_clean(load.answers)
    after = load.answers[killed:]
    assert {a.status for a in after} == {503} and {a.error_type for a in after} == {"not_ready_error"}
