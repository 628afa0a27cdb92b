"""A pool of remote replicas (``slotread engine`` or vLLM servers) that reads are sent to.

A replica that is slow and one that is gone are different things, and only the second leaves the
rotation (as Envoy's outlier detection and active health checks keep them apart):

* **Choice**: a read goes to the replica in rotation with the fewest reads outstanding; ties go round.
* **Time**: a read may take until its decision's deadline (``engines.deadline``: the server sets it from
  ``--request-deadline``), else ``timeout_s``. A read unanswered by then raises ``UpstreamTimeout``, a
  529: the replicas are busy, and a busy replica is a load problem, which the server's admission gate
  handles by predicted cost. Taking a slow replica out would only load the others more.
* **Gone**: a replica leaves the rotation on evidence that it is gone or broken. Certain evidence takes
  out any replica, the last included: a refused connection (nothing listens), a health check answered
  with an error status, a 404 to a read (it serves another model now). Evidence that could be load takes
  one out only while another stays in rotation: ``FAILED_CHECKS`` health checks in a row unanswered
  within ``HEALTH_TIMEOUT_S`` (a stopped or hung process), or ``FAILED_READS`` reads in a row answered
  5xx (then it stays out ``EJECTION_S`` at least, though its health route answers).
* **Failover**: a read that never reached a replica (connection refused, the replica busy: 429, 503,
  529, or a 404) goes to another replica in rotation. A read that reached one and failed there (the
  connection broke, a 5xx, or its replica left the rotation while the read waited on it) is sent again
  once, to another replica where there is one; reads are idempotent. A failure after that is
  ``UpstreamUnavailable``, as is an empty rotation, with ``retry_after`` = one health interval.
* **Health**: each replica's health route (``/healthz`` as slotread serves it, else ``/health`` as vLLM
  does) is fetched every ``health_interval_s``, and ``RECHECK_S`` after a failed check. A replica out of
  rotation whose check passes comes back once ``admit`` accepts its ``/v1/models`` (a restarted replica
  may serve another model).
* Any other answer than 200, busy, 404 or 5xx (a 4xx: the gateway and the replica disagree on the wire)
  raises ``UpstreamError`` at once: trying elsewhere would only hide the bug.

The pool knows HTTP and bytes, not what a read means. Its requests and checks run on an event loop in
a thread of its own, so a read waits on its replica and on that replica leaving the rotation at once,
and moves when it leaves; callers in any thread send a call's bodies with ``post_all``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from slotread.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

logger = logging.getLogger(__name__)

#: health routes to try, in order: slotread's, then vLLM's
HEALTH_PATHS = ("/healthz", "/health")
#: a replica answering one of these is busy or starting, not broken: try another
BUSY = frozenset({429, 503, 529})
#: how long a health check (or a model listing) may take
HEALTH_TIMEOUT_S = 1.0
#: unanswered health checks in a row that take a replica out (one can be a moment's load)
FAILED_CHECKS = 2
#: seconds to the next check after a failed one: a stopped replica is found out in about two of these
RECHECK_S = 0.5
#: reads in a row answered 5xx that take a replica out
FAILED_READS = 3
#: seconds a replica taken out for failing reads stays out, though its health route answers
EJECTION_S = 10.0

_JSON = {"content-type": "application/json"}
T = TypeVar("T")

#: ``admit(listing)`` says why a replica's ``GET /v1/models`` JSON rules it out, or None to admit it
Admit = Callable[[Any], str | None]


@dataclass
class Replica:
    """One upstream server and what the pool knows about it (changed on the pool's loop only)."""

    url: str
    #: in rotation: reads may be sent to it
    up: bool = False
    outstanding: int = 0
    #: reads sent, by outcome: ok, failed (the connection failed, or a 5xx), busy, refused (another status),
    #: moved (it left the rotation while the read waited on it), late (the read's deadline passed there)
    outcomes: Counter[str] = field(default_factory=Counter)
    #: the health route this replica answered on, once known
    health_path: str | None = None
    #: why it is out of rotation, for logs and errors
    reason: str = "not checked yet"
    failed_checks: int = 0
    failed_reads: int = 0
    #: ``time.monotonic()`` before which it is not taken back
    out_until: float = 0.0
    #: done when it leaves the rotation: the reads waiting on it move
    gone: asyncio.Future[None] | None = None


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's state at one moment, for metrics and ``/readyz``."""

    url: str
    up: bool
    outstanding: int
    outcomes: dict[str, int]


@dataclass(frozen=True)
class _Failed:
    """An attempt that did not get an answer; ``reached``: the read may have run on the replica."""

    problem: str
    reached: bool


class ReplicaPool:
    """Sends reads to the least busy replica in rotation, failing over and health-checking."""

    def __init__(
        self, urls: Sequence[str], *, timeout_s: float, health_interval_s: float, max_in_flight: int = 64
    ) -> None:
        if not urls:
            raise ValueError("a replica pool needs at least one URL")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()  # the replicas' state, read from other threads
        self._turn = 0
        self._admit: Admit = lambda listing: None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slotread-upstreams", daemon=True)
        self._thread.start()
        self._client, self._in_flight = self._run(self._open())
        self._watchers: list[asyncio.Task[None]] = []

    async def _open(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        # Reads are bounded by the semaphore, so the client need not bound connections (a bounded pool
        # would raise PoolTimeout, which must not count against a replica).
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), follow_redirects=False)
        return client, asyncio.Semaphore(self._max_in_flight)

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the pool's loop and wait for it (from any thread but the loop's)."""
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    # --- reads ------------------------------------------------------------------------------------

    def post_all(self, path: str, bodies: Sequence[bytes], answer_by: float | None = None) -> list[bytes]:
        """POST each JSON body to ``path`` on a replica, all at once; their answers' bodies, in order.

        ``answer_by`` (``time.monotonic()``): when to stop waiting, else ``timeout_s`` from now. Raises
        UpstreamTimeout, UpstreamUnavailable or UpstreamError (see the module's docstring); the first
        to fail cancels the rest."""
        deadline = time.monotonic() + self.timeout_s if answer_by is None else answer_by
        return self._run(self._post_all(path, bodies, deadline))

    def get(self, url: str, path: str) -> httpx.Response:
        """GET ``path`` from the replica at ``url`` (a model listing); transport errors propagate."""
        return self._run(self._client.get(url.rstrip("/") + path, timeout=HEALTH_TIMEOUT_S))

    async def _post_all(self, path: str, bodies: Sequence[bytes], deadline: float) -> list[bytes]:
        tasks = [asyncio.ensure_future(self._post(path, body, deadline)) for body in bodies]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [outcome for outcome in outcomes if isinstance(outcome, bytes)]

    async def _post(self, path: str, body: bytes, deadline: float) -> bytes:
        try:
            async with asyncio.timeout_at(self._loop.time() + deadline - time.monotonic()):
                await self._in_flight.acquire()  # a cancelled acquire gives its permit back
        except TimeoutError:
            raise UpstreamTimeout(
                f"the read waited for one of the {self._max_in_flight} upstream requests in flight until its "
                "deadline passed",
                self.health_interval_s,
            ) from None
        try:
            return await self._send(path, body, deadline)
        finally:
            self._in_flight.release()

    async def _send(self, path: str, body: bytes, deadline: float) -> bytes:
        """Send one read until a replica answers it, within the failover rules."""
        tried: set[str] = set()
        problems: list[str] = []
        resent = reached = False
        while True:
            replica = self._choose(tried)
            if replica is None and reached:
                replica = self._choose(set())  # the resend goes to the same replica where no other is left
            if replica is None:
                raise UpstreamUnavailable(self._unavailable(problems), self.health_interval_s)
            tried.add(replica.url)
            outcome = await self._attempt(replica, path, body, deadline)
            if isinstance(outcome, bytes):
                return outcome
            problems.append(outcome.problem)
            reached = outcome.reached
            if reached:
                if resent:
                    raise UpstreamUnavailable(self._unavailable(problems), self.health_interval_s)
                resent = True

    async def _attempt(self, replica: Replica, path: str, body: bytes, deadline: float) -> bytes | _Failed:
        """One try of a read on ``replica``; raises UpstreamTimeout past the deadline, UpstreamError on a 4xx."""
        assert replica.gone is not None, "a replica in rotation has its gone future"
        gone, started = replica.gone, time.monotonic()
        left = max(0.0, deadline - started)
        request = asyncio.ensure_future(
            self._client.post(replica.url + path, content=body, headers=_JSON, timeout=left)
        )
        self._count(replica, outstanding=+1)
        try:
            either: set[asyncio.Future[Any]] = {request, gone}
            await asyncio.wait(either, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not request.done():
                request.cancel()
                with contextlib.suppress(BaseException):
                    await request
            self._count(replica, outstanding=-1)
        if request.cancelled():
            if gone.done():
                self._count(replica, "moved")
                return _Failed(f"{replica.url}: left the rotation while reading ({replica.reason})", reached=True)
            self._count(replica, "late")
            raise self._late(replica, started)
        try:
            response = request.result()
        except httpx.TimeoutException:
            self._count(replica, "late")
            raise self._late(replica, started) from None
        except httpx.ConnectError as exc:
            self._count(replica, "failed")
            self._take_out(replica, _describe(exc), certain=True)
            return _Failed(f"{replica.url}: {_describe(exc)}", reached=False)
        except httpx.TransportError as exc:  # broke mid-read: a killed replica, or a kept-alive connection closed
            self._count(replica, "failed")
            return _Failed(f"{replica.url}: {_describe(exc)}", reached=True)
        status = response.status_code
        if status == 200:
            replica.failed_reads = 0
            self._count(replica, "ok")
            return response.content
        if status in BUSY:
            self._count(replica, "busy")
            return _Failed(f"{replica.url}: busy ({status})", reached=False)
        if status == 404:
            self._count(replica, "refused")
            self._take_out(replica, f"{path} answered 404: {_error_text(response)}", certain=True)
            return _Failed(f"{replica.url}{path} answered 404: {_error_text(response)}", reached=False)
        if status >= 500:
            self._count(replica, "failed")
            replica.failed_reads += 1
            if replica.failed_reads >= FAILED_READS:
                reason = f"{replica.failed_reads} reads in a row answered 5xx, the last {status}"
                self._take_out(replica, reason, certain=False, out_for=EJECTION_S)
            return _Failed(f"{replica.url}{path} answered {status}: {_error_text(response)}", reached=True)
        self._count(replica, "refused")
        raise UpstreamError(f"{replica.url}{path} answered {status}: {_error_text(response)}")

    def _late(self, replica: Replica, started: float) -> UpstreamTimeout:
        return UpstreamTimeout(
            f"the decision's deadline passed {time.monotonic() - started:.1f} s into a read on {replica.url} "
            f"(in rotation, {replica.outstanding} other reads outstanding there): the replicas are busy",
            self.health_interval_s,
        )

    def _choose(self, tried: set[str]) -> Replica | None:
        """The untried replica in rotation with the fewest outstanding reads (ties in turn)."""
        count = len(self.replicas)
        candidates = [
            (replica.outstanding, (index - self._turn) % count, index)
            for index, replica in enumerate(self.replicas)
            if replica.up and replica.url not in tried
        ]
        if not candidates:
            return None
        index = min(candidates)[2]
        self._turn = index + 1
        return self.replicas[index]

    def _count(self, replica: Replica, outcome: str | None = None, outstanding: int = 0) -> None:
        with self._lock:
            replica.outstanding += outstanding
            if outcome is not None:
                replica.outcomes[outcome] += 1

    def _unavailable(self, problems: list[str]) -> str:
        with self._lock:
            down = [f"{replica.url}: {replica.reason}" for replica in self.replicas if not replica.up]
        return "no upstream replica could take the read (" + "; ".join(problems + down) + ")"

    # --- rotation and health ----------------------------------------------------------------------

    def start(self, admit: Admit) -> None:
        """Check every replica once now (so those that pass are in rotation on return), then keep
        checking each in the background until ``close``."""
        self._admit = admit
        self._run(self._start())

    async def _start(self) -> None:
        passed = await asyncio.gather(*(self._check(replica) for replica in self.replicas))
        self._watchers = [asyncio.ensure_future(self._watch(*pair)) for pair in zip(self.replicas, passed, strict=True)]

    def close(self) -> None:
        """Stop the health checks, end the reads in flight (their callers get CancelledError), close
        the connections and the loop."""
        if self._loop.is_closed():
            return
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close(self) -> None:
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._client.aclose()

    @property
    def any_up(self) -> bool:
        """Whether any replica is in rotation."""
        return self.in_rotation() > 0

    def in_rotation(self) -> int:
        """How many replicas are in rotation."""
        with self._lock:
            return sum(replica.up for replica in self.replicas)

    def stats(self) -> list[ReplicaStats]:
        """Every replica's state now."""
        with self._lock:
            return [
                ReplicaStats(replica.url, replica.up, replica.outstanding, dict(replica.outcomes))
                for replica in self.replicas
            ]

    def check(self) -> None:
        """One health check of every replica now: take failing ones out, bring passing ones back."""
        self._run(self._check_all())

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))

    async def _watch(self, replica: Replica, passed: bool) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s if passed else min(RECHECK_S, self.health_interval_s))
            passed = await self._check(replica)

    async def _check(self, replica: Replica) -> bool:
        """One health check of ``replica``; whether it passed."""
        try:
            status = await self._health_status(replica)
        except httpx.ConnectError as exc:
            self._take_out(replica, f"health check failed: {_describe(exc)}", certain=True)
            return False
        except httpx.HTTPError as exc:  # no answer in time, or a broken one: a stopped process, or load
            replica.failed_checks += 1
            if replica.failed_checks >= FAILED_CHECKS:
                reason = f"its health checks went unanswered ({_describe(exc)})"
                self._take_out(replica, reason, certain=False)
            return False
        if status != 200:
            self._take_out(replica, f"health check answered {status}", certain=True)
            return False
        replica.failed_checks = 0
        if replica.up:
            replica.reason = ""  # what it was kept in rotation through is over
        elif time.monotonic() >= replica.out_until:
            problem = await self._admission_problem(replica)
            if problem is not None:
                self._take_out(replica, problem, certain=True)
                return False
            self._bring_back(replica)
        return True

    async def _health_status(self, replica: Replica) -> int:
        """The status of the replica's health route (found on the first check, slotread's or vLLM's)."""
        status = 0
        for path in [replica.health_path] if replica.health_path else HEALTH_PATHS:
            status = (await self._client.get(replica.url + path, timeout=HEALTH_TIMEOUT_S)).status_code
            if status == 200:
                replica.health_path = path
                return status
            if status != 404:
                break
        return status

    async def _admission_problem(self, replica: Replica) -> str | None:
        """None if the replica's model listing is one ``admit`` accepts, else why not."""
        try:
            response = await self._client.get(replica.url + "/v1/models", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"GET /v1/models failed: {_describe(exc)}"
        if response.status_code != 200:
            return f"GET /v1/models answered {response.status_code}"
        try:
            listing = response.json()
        except ValueError:
            return "GET /v1/models did not answer JSON"
        return self._admit(listing)

    def _take_out(self, replica: Replica, reason: str, *, certain: bool, out_for: float = 0.0) -> None:
        """Take ``replica`` out of rotation; on uncertain evidence only while another stays in it."""
        with self._lock:
            was_up, changed = replica.up, replica.reason != reason
            last = was_up and not any(other.up for other in self.replicas if other is not replica)
            if last and not certain:
                replica.reason = reason  # not shown while it is up; kept to log it once
            else:
                replica.up, replica.reason = False, reason
                replica.out_until = max(replica.out_until, time.monotonic() + out_for)
        if last and not certain:
            if changed:
                logger.warning("upstream %s stays in rotation, the last one, though %s", replica.url, reason)
            return
        if replica.gone is not None and not replica.gone.done():
            replica.gone.set_result(None)
        if was_up:
            logger.warning("upstream %s left the rotation: %s", replica.url, reason)
        elif changed:
            logger.info("upstream %s stays out of rotation: %s", replica.url, reason)

    def _bring_back(self, replica: Replica) -> None:
        replica.failed_reads = 0
        replica.gone = asyncio.get_running_loop().create_future()
        with self._lock:
            replica.up, replica.reason = True, ""
        logger.info("upstream %s is in rotation", replica.url)


def _describe(exc: httpx.HTTPError) -> str:
    """A transport error in a few words: its kind and httpx's message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_text(response: httpx.Response) -> str:
    """The message of an OpenAI-style ``{"error": {"message"}}`` body, else the start of the body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return response.text[:300]
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return response.text[:300]
