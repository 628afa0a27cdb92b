"""The decision service: the Decider behind the admission gate, in a bounded pool of worker threads.

A decision takes a slot from the ``AdmissionGate`` (or is refused with 529), then runs
``Decider.decide`` in one of ``max_concurrency`` threads (torch releases the GIL in its kernels).
The threads share an in-process engine through a ``BatchingEngine``, which reads one merged batch at
a time; a remote engine is used by all threads at once (its replicas batch, and serialising its
calls would leave them idle). A decision that has started runs to the end even if its client leaves: a read in progress
cannot be interrupted, and its slot is freed when it finishes. A remote engine's reads wait until the
decision's deadline (its arrival plus ``request_deadline_s``, ``engines.deadline``) and no longer: past
it the decision is answered 529, with the gate's estimate of when one would fit.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slotread.decider import Decider
from slotread.engines.base import Counted
from slotread.engines.deadline import answering_by
from slotread.engines.remote.engine import RemoteEngine
from slotread.errors import NotReady, SlotreadError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from slotread.serve.admission import AdmissionGate
from slotread.serve.auth import ApiKeys
from slotread.serve.batcher import BatchingEngine
from slotread.serve.metrics import Metrics
from slotread.settings import Settings

logger = logging.getLogger(__name__)

#: answered once before the server reports ready
_WARM_UP = {"state": "The server is up.", "questions": {"up": {"type": "noul", "instructions": "Is the server up?"}}}


class DecisionService:
    """Owns the gate, the worker pool, the API keys and (once loaded) the Decider."""

    def __init__(self, settings: Settings, metrics: Metrics, api_keys: ApiKeys | None) -> None:
        self.settings = settings
        self.metrics = metrics
        #: None: auth is off
        self.api_keys = api_keys
        self.gate = AdmissionGate(settings.max_concurrency, settings.queue_size, settings.retry_after_s)
        metrics.track_queue(lambda: self.gate.waiting, lambda: self.gate.running)
        self.decider: Decider | None = None
        #: why the model failed to load, if it did
        self.load_error: str | None = None
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker threads."""
        self._pool = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="slotread-decide")

    def stop(self) -> None:
        """Wait for the decisions in flight, then stop the worker threads and close the Decider."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.decider is not None:
            self.decider.close()

    async def load(self, load: Callable[[], Decider]) -> None:
        """Build the Decider in a thread (a first start fetches and converts the model: minutes), then
        answer one small decision so the first client does not pay for first-call allocations."""
        try:
            decider = await asyncio.to_thread(load)
            self._share(decider)  # before the warm-up: its reads run in the engine thread too
            await self._warm_up(decider)
        except Exception as exc:
            self.load_error = str(exc)
            if isinstance(exc, SlotreadError):  # a reason, not a bug: its message says it all
                logger.error("the model failed to load; the server stays unready: %s", exc)
            else:
                logger.exception("the model failed to load; the server stays unready")
            return
        self.serve(decider)

    async def _warm_up(self, decider: Decider) -> None:
        """Answer ``_WARM_UP``. Through upstreams a failed read is the replicas' state, not a failed load:
        a replica still compiling its kernels (its first read can outlast ``upstream_timeout_s``) or
        out of rotation for now answers later, and readiness follows the rotation."""
        try:
            await asyncio.to_thread(decider.decide, _WARM_UP)
        except (UpstreamUnavailable, UpstreamTimeout, UpstreamError) as exc:
            logger.warning("the warm-up decision failed on the upstreams; serving anyway: %s", exc)

    def _share(self, decider: Decider) -> None:
        """Share an in-process engine through a BatchingEngine, which runs every engine call in one
        thread (on the CPU torch computes slower once several threads have used it)."""
        if not isinstance(decider.engine, RemoteEngine | BatchingEngine):
            decider.engine = BatchingEngine(decider.engine, self.metrics.observe_batch)

    def serve(self, decider: Decider) -> None:
        """Answer decisions with ``decider`` from now on; an in-process engine is shared through a
        BatchingEngine."""
        self._share(decider)
        if isinstance(decider.engine, RemoteEngine):
            self.metrics.track_replicas(decider.engine.pool.stats)
            self.gate.track_capacity(decider.engine.pool.in_rotation)
        else:
            batcher = decider.engine
            assert isinstance(batcher, BatchingEngine)
            self.metrics.track_engine(lambda: batcher.pending)
            if isinstance(batcher.engine, Counted):
                self.metrics.track_engine_counters(batcher.engine)
        self.decider = decider
        logger.info("ready: serving %s", decider.name)

    @property
    def upstreams(self) -> RemoteEngine | None:
        """The remote engine, when decisions are read on upstream replicas."""
        engine = self.decider.engine if self.decider is not None else None
        return engine if isinstance(engine, RemoteEngine) else None

    @property
    def ready(self) -> bool:
        """Whether decisions can be answered: the model is loaded, its engine's process (if it has one)
        runs and, with upstreams, one is in rotation."""
        remote = self.upstreams
        return (
            self.decider is not None
            and self._pool is not None
            and not self.engine_exited
            and (remote is None or remote.pool.any_up)
        )

    @property
    def engine_exited(self) -> bool:
        """Whether the engine's own process (``--engine-process``) has ended: only a restart helps."""
        process = self.decider.engine_process if self.decider is not None else None
        return process is not None and process.exit_code is not None

    @property
    def unready_reason(self) -> str:
        """Why decisions cannot be answered (yet)."""
        if self.load_error:
            return f"the model failed to load: {self.load_error}"
        if self.engine_exited:
            assert self.decider is not None and self.decider.engine_process is not None
            return self.decider.engine_process.exited()
        if self.upstreams is not None:
            return "no upstream replica is in rotation"
        return "the model is loading"

    def ready_decider(self) -> Decider:
        """The Decider, or NotReady saying why there is none."""
        if self.decider is None or self._pool is None or self.engine_exited:
            raise NotReady(self.unready_reason)
        return self.decider

    async def decide(
        self,
        body: Any,
        disconnected: Callable[[], Awaitable[bool]],
        priority: int = 0,
        parts: dict[str, bytes] | None = None,
    ) -> dict[str, Any]:
        """Answer a System One body (``parts``: a multipart body's files); raises Overloaded, ClientGone,
        NotReady or the Decider's errors. Its questions are its cost at the gate (reads grow with them)."""
        decider = self.ready_decider()
        queued = time.perf_counter()
        deadline_s = self.settings.request_deadline_s
        answer_by = time.monotonic() + deadline_s
        cost = len(body["questions"]) if isinstance(body, dict) and isinstance(body.get("questions"), dict) else 1
        cost = max(1, cost)
        key = _digest(body)  # a client sends a refused request again as it was: it finds its booking
        async with self.gate.slot(deadline_s, disconnected, priority, cost, key):
            started = time.perf_counter()
            self.metrics.queue_wait.observe(started - queued)
            try:
                loop = asyncio.get_running_loop()
                decide = functools.partial(_decide_by, decider, answer_by)
                response: dict[str, Any] = await loop.run_in_executor(self._pool, decide, body, parts)
            except UpstreamTimeout as exc:
                raise self.gate.refusal(str(exc), deadline_s, cost, key) from exc
            finally:
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self.metrics.questions.inc(len(response["answers"]))
        return response


def _digest(body: Any) -> bytes:
    """The request's identity at the gate (``AdmissionGate.refusal``): a digest of its body."""
    return hashlib.blake2b(json.dumps(body, sort_keys=True, default=str).encode(), digest_size=16).digest()


def _decide_by(decider: Decider, answer_by: float, body: Any, parts: dict[str, bytes] | None) -> dict[str, Any]:
    """``decider.decide`` with its reads needed by ``answer_by`` (``time.monotonic()``)."""
    with answering_by(answer_by):
        return decider.decide(body, parts)
