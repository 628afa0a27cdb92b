"""Prometheus metrics: requests by route and status, latency, questions, reads, queue depth, the
engine's own counts (prefix cache hits, tokens computed, CUDA graph captures), the process's CPU
time, and on a gateway each upstream replica's state and requests by outcome.

Each app gets its own ``CollectorRegistry`` (tests start several servers in one process; the
global registry would refuse the second set of names). ``MetricsMiddleware`` counts every response,
errors included, labelled with the route's path template so unknown paths cannot grow the label set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotread.engines.base import Counted
from slotread.engines.remote.pool import ReplicaStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's metrics, registered in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "slotread_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "slotread_request_seconds", "time to answer", ["route"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.queue_wait = Histogram(
            "slotread_queue_wait_seconds",
            "time a decision waited for a slot",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "slotread_decision_seconds",
            "time a decision held its slot",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.questions = Counter("slotread_questions", "questions answered", registry=self.registry)
        self.reads = Counter("slotread_reads", "reads sent to the engine", registry=self.registry)
        self.batches = Counter("slotread_engine_batches", "engine calls (merged batches)", registry=self.registry)
        # busy seconds over wall seconds: whether the engine or what feeds it holds throughput back
        self.busy = Counter("slotread_engine_busy_seconds", "time spent in engine calls", registry=self.registry)
        self.queue_depth = Gauge("slotread_queue_depth", "decisions waiting for a slot", registry=self.registry)
        self.running = Gauge("slotread_running", "decisions holding a slot", registry=self.registry)
        self.pending_reads = Gauge("slotread_pending_reads", "reads waiting for the engine", registry=self.registry)
        # process_cpu_seconds_total: the benchmarks divide it by decisions (host CPU per decision)
        ProcessCollector(registry=self.registry)

    def track_queue(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the queue depth and running count from the admission gate at scrape time."""
        self.queue_depth.set_function(waiting)
        self.running.set_function(running)

    def track_engine(self, pending: Callable[[], int]) -> None:
        """Read the reads waiting for the engine from the batcher at scrape time."""
        self.pending_reads.set_function(pending)

    def track_engine_counters(self, engine: Counted) -> None:
        """Export the engine's counters as ``slotread_engine_<name>`` counters, read at scrape time."""
        self.registry.register(_EngineCollector(engine))

    def track_replicas(self, stats: Callable[[], list[ReplicaStats]]) -> None:
        """Report the upstream replicas' state, read from the pool at scrape time."""
        self.registry.register(_ReplicaCollector(stats))

    def observe_batch(self, reads: int, seconds: float) -> None:
        """Count one engine call of ``reads`` reads that took ``seconds``."""
        self.batches.inc()
        self.reads.inc(reads)
        self.busy.inc(seconds)


class _ReplicaCollector(Collector):
    """Per replica: in rotation or not, requests outstanding, requests sent by outcome."""

    def __init__(self, stats: Callable[[], list[ReplicaStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("slotread_upstream_up", "1 while the replica is in rotation", labels=["replica"])
        outstanding = GaugeMetricFamily(
            "slotread_upstream_outstanding", "requests waiting for the replica", labels=["replica"]
        )
        sent = CounterMetricFamily(
            "slotread_upstream_requests",
            "requests sent to the replica, by outcome (ok, failed, busy, refused, moved, late: engines/remote/pool.py)",
            labels=["replica", "outcome"],
        )
        for replica in self._stats():
            up.add_metric([replica.url], float(replica.up))
            outstanding.add_metric([replica.url], replica.outstanding)
            for outcome, count in sorted(replica.outcomes.items()):
                sent.add_metric([replica.url, outcome], count)
        yield from (up, outstanding, sent)


class _EngineCollector(Collector):
    """The engine's running totals (``Counted.counters``)."""

    def __init__(self, engine: Counted) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        for name, value in self._engine.counters().items():
            yield CounterMetricFamily(f"slotread_engine_{name}", f"engine: {name.replace('_', ' ')}", value=value)


def _route(scope: Scope, root_path: str) -> str:
    """The path template of the route that answered, or "unmatched".

    FastAPI records its own routes in the scope, but not Starlette's plain routes and mounts (``/openapi.json``,
    the documentation assets), so those are looked up among the app's routes, under the ``root_path`` the
    request came with (a mount moves the scope's own to its prefix).
    """
    if "route" in scope:
        return str(scope["route"].path)
    arrived = {**scope, "root_path": root_path}
    for route in getattr(scope.get("app"), "routes", ()):
        if route.matches(arrived)[0] is Match.FULL:
            return str(route.path)
    return "unmatched"


class MetricsMiddleware:
    """Counts and times every HTTP response by route and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        root_path = scope.get("root_path", "")
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            counted = True
            self.metrics.requests.labels(_route(scope, root_path), str(status)).inc()

        async def send_status(message: Message) -> None:
            # counted when the status goes out, before the body: a client that has its answer finds it counted
            if message["type"] == "http.response.start":
                count(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if not counted:
                count(500)  # what the client sees if the app raises before answering
            self.metrics.latency.labels(_route(scope, root_path)).observe(time.perf_counter() - started)
