"""A pool of remote replicas (slotread engine or vLLM servers) that reads are sent to.

* **Choice**: a request goes to the replica in rotation with the fewest requests outstanding; ties
  go round the pool, so light load spreads evenly too.
* **Failover**: when a replica cannot be reached (connection refused, reset, or no answer in time)
  the request is sent to another replica. A replica that refused the connection or timed out leaves
  the rotation at once; one whose connection broke mid-request (a killed process, or a keep-alive
  connection closed under us) is skipped for this request only, and the next request or health
  check finds out which it was. A replica that says it is busy (429, 503, 529) is skipped too.
* **Timeout**: a request gets ``timeout_s`` in all, retries included; a replica that does not answer
  in that time leaves the rotation.
* **Health**: every ``health_interval_s`` each replica's health route is fetched (``/healthz`` as
  slotread serves it, else ``/health`` as vLLM does; whichever answers is kept). A replica that
  fails leaves the rotation; one that passes comes back once ``admit`` accepts its ``/v1/models``
  (a restarted replica may serve another model).
* **Nothing left**: ``UpstreamUnavailable`` with ``retry_after`` = one health interval, the soonest a
  replica can come back. Any other answer than 200 or busy raises ``UpstreamError`` at once: a read
  the gateway built is refused alike everywhere, so trying elsewhere would only hide the bug.

The pool knows HTTP and JSON, not what a read means. It is thread-safe: reads of many decisions go
through it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from slotread.errors import UpstreamError, UpstreamUnavailable

logger = logging.getLogger(__name__)

#: health routes to try, in order: slotread's, then vLLM's
HEALTH_PATHS = ("/healthz", "/health")
#: a replica answering one of these is busy or starting, not broken: try another
BUSY = frozenset({429, 503, 529})
#: how long a health check (or a model listing) may take
HEALTH_TIMEOUT_S = 1.0

#: ``admit(listing)`` says why a replica's ``GET /v1/models`` JSON rules it out, or None to admit it
Admit = Callable[[Any], str | None]


@dataclass
class Replica:
    """One upstream server and what the pool knows about it."""

    url: str
    #: in rotation: reads may be sent to it
    up: bool = False
    outstanding: int = 0
    #: requests sent, by outcome: ok, failed (unreachable or too slow), busy, refused (any other status)
    outcomes: Counter[str] = field(default_factory=Counter)
    #: the health route this replica answered on, once known
    health_path: str | None = None
    #: why it is out of rotation, for logs and errors
    reason: str = "not checked yet"


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's state at one moment, for metrics and ``/readyz``."""

    url: str
    up: bool
    outstanding: int
    outcomes: dict[str, int]


class ReplicaPool:
    """Sends JSON requests to the least busy replica in rotation, failing over and health-checking."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float, health_interval_s: float) -> None:
        if not urls:
            raise ValueError("a replica pool needs at least one URL")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        # Reads are bounded by the caller's executor, so the client need not bound connections (a
        # bounded pool would raise PoolTimeout, which must not count against a replica).
        self._client = httpx.Client(limits=httpx.Limits(max_connections=None), follow_redirects=False)
        self._lock = threading.Lock()
        self._turn = 0
        self._admit: Admit = lambda listing: None
        self._stop = threading.Event()
        self._checker: threading.Thread | None = None

    # --- reads ------------------------------------------------------------------------------------

    def post(self, path: str, body: Any) -> Any:
        """POST ``body`` as JSON to ``path`` on a replica and return the JSON answer.

        Raises UpstreamUnavailable when no replica answers within ``timeout_s``, UpstreamError when
        one refuses the request or answers with something other than JSON.
        """
        deadline = time.monotonic() + self.timeout_s
        tried: set[str] = set()
        problems: list[str] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                problems.append(f"no answer within {self.timeout_s:g} s")
                break
            replica = self._acquire(tried)
            if replica is None:
                break
            tried.add(replica.url)
            try:
                response = self._client.post(replica.url + path, json=body, timeout=left)
            except (httpx.ConnectError, httpx.TimeoutException) as exc:
                self._failed(replica, exc, leave=True)
                problems.append(f"{replica.url}: {_describe(exc)}")
                continue
            except httpx.TransportError as exc:
                self._failed(replica, exc, leave=False)
                problems.append(f"{replica.url}: {_describe(exc)}")
                continue
            finally:
                self._release(replica)
            if response.status_code in BUSY:
                self._count(replica, "busy")
                problems.append(f"{replica.url}: busy ({response.status_code})")
                continue
            if response.status_code != 200:
                self._count(replica, "refused")
                raise UpstreamError(f"{replica.url}{path} answered {response.status_code}: {_error_text(response)}")
            self._count(replica, "ok")
            try:
                return response.json()
            except ValueError as exc:
                raise UpstreamError(f"{replica.url}{path} answered 200 with a body that is not JSON") from exc
        raise UpstreamUnavailable(self._unavailable_message(problems), self.health_interval_s)

    def get(self, url: str, path: str) -> httpx.Response:
        """GET ``path`` from the replica at ``url`` (health and model listings); transport errors propagate."""
        return self._client.get(url.rstrip("/") + path, timeout=HEALTH_TIMEOUT_S)

    def _acquire(self, tried: set[str]) -> Replica | None:
        """The untried replica in rotation with the fewest outstanding requests (ties in turn), now counted."""
        with self._lock:
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
            replica = self.replicas[index]
            replica.outstanding += 1
            return replica

    def _release(self, replica: Replica) -> None:
        with self._lock:
            replica.outstanding -= 1

    def _count(self, replica: Replica, outcome: str) -> None:
        with self._lock:
            replica.outcomes[outcome] += 1

    def _failed(self, replica: Replica, exc: httpx.TransportError, leave: bool) -> None:
        with self._lock:
            replica.outcomes["failed"] += 1
        if leave:
            self._mark_down(replica, _describe(exc))

    def _unavailable_message(self, problems: list[str]) -> str:
        with self._lock:
            down = [f"{replica.url}: {replica.reason}" for replica in self.replicas if not replica.up]
        return "no upstream replica could take the read (" + "; ".join(problems + down) + ")"

    # --- rotation and health ----------------------------------------------------------------------

    def start(self, admit: Admit) -> None:
        """Check every replica once now (so those that pass are in rotation on return), then every
        ``health_interval_s`` in a background thread until ``close``."""
        self._admit = admit
        self.check()
        self._checker = threading.Thread(target=self._check_forever, name="slotread-health", daemon=True)
        self._checker.start()

    def close(self) -> None:
        """Stop the health checks and close the connections."""
        self._stop.set()
        if self._checker is not None:
            self._checker.join()
        self._client.close()

    @property
    def any_up(self) -> bool:
        """Whether any replica is in rotation."""
        with self._lock:
            return any(replica.up for replica in self.replicas)

    def stats(self) -> list[ReplicaStats]:
        """Every replica's state now."""
        with self._lock:
            return [
                ReplicaStats(replica.url, replica.up, replica.outstanding, dict(replica.outcomes))
                for replica in self.replicas
            ]

    def check(self) -> None:
        """One health check of every replica: take failing ones out, admit passing ones back."""
        for replica in self.replicas:
            problem = self._health_problem(replica)
            if problem is None and not replica.up:
                problem = self._admission_problem(replica)
                if problem is None:
                    with self._lock:
                        replica.up, replica.reason = True, ""
                    logger.info("upstream %s is in rotation", replica.url)
                    continue
            if problem is not None:
                self._mark_down(replica, problem)

    def _check_forever(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            self.check()

    def _mark_down(self, replica: Replica, reason: str) -> None:
        with self._lock:
            was_up, changed = replica.up, replica.reason != reason
            replica.up, replica.reason = False, reason
        if was_up:
            logger.warning("upstream %s left the rotation: %s", replica.url, reason)
        elif changed:
            logger.info("upstream %s stays out of rotation: %s", replica.url, reason)

    def _health_problem(self, replica: Replica) -> str | None:
        """None if the replica's health route answers 200, else what went wrong."""
        paths = [replica.health_path] if replica.health_path else HEALTH_PATHS
        status = 0
        for path in paths:
            try:
                status = self.get(replica.url, path).status_code
            except httpx.HTTPError as exc:
                return f"health check failed: {_describe(exc)}"
            if status == 200:
                replica.health_path = path
                return None
            if status != 404:
                break
        return f"health check answered {status}"

    def _admission_problem(self, replica: Replica) -> str | None:
        """None if the replica's model listing is one ``admit`` accepts, else why not."""
        try:
            response = self.get(replica.url, "/v1/models")
        except httpx.HTTPError as exc:
            return f"GET /v1/models failed: {_describe(exc)}"
        if response.status_code != 200:
            return f"GET /v1/models answered {response.status_code}"
        try:
            listing = response.json()
        except ValueError:
            return "GET /v1/models did not answer JSON"
        return self._admit(listing)


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
