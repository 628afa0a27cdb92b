"""Merge the reads of concurrent decisions into one engine batch, one engine call at a time.

The server runs several decisions in worker threads; each calls ``Engine.read`` for its stages.
``BatchingEngine`` wraps the model's engine and lets one call run at a time (the engines' prefix
caches are not thread-safe), and a thread that finds the engine free reads everything queued
meanwhile in one batch. Batching across requests changes no answer beyond the engine's tolerance
(``engines/base.py``): on the CPU the causal engine's answers are bit-identical in any batch.

Thoughts (``x_think``) queue the same way: the thoughts of every decision queued meanwhile are
generated in one ``Engine.think`` call (a causal model steps all of them together; merging changes
float rounding only), beside the merged reads. A deterministic engine's thoughts are generated one
decision at a time, so a thought never depends on its neighbours.

If a merged batch raises, each caller's part of it runs again alone, so one failing request cannot
fail its neighbours' decisions. A caller may say how to tell that nobody waits for its reads any
more (``abandoned``: an engine server's client that hung up, a gateway past its deadline); such reads
are dropped when their call would start (``ReadAbandoned``), so an engine that has fallen behind
spends its time on reads someone still waits for, not on answers nobody will read.

Every engine call runs in one thread of the batcher's own, whichever caller leads it. On the CPU,
torch's kernels ran ~1.6x slower (a DiffusionGemma read: 24 ms, then 40) once a second thread had
computed with them, and a server's leaders are its decision threads in turn.

A call may wait a little for more callers before it starts (``_gather``). Clients that each wait for
their answer before asking again (a benchmark's, a pipeline's) otherwise settle into two halves that
take turns: the half that arrives while a call runs is the next call, and it never meets the other
half again. Each call then reads half of what it could: W1 at concurrency 32 on an H200 ran calls
of ~16 decisions, 75 decisions/s, where the engine alone reads 129 in calls of 32 (bench/RESULTS.md).
So a call that follows another at once waits until as many callers are queued as were waiting or
running at once during the last call, for at most a tenth of that call's time (50 ms at most). A lone
caller never waits, nor does one that finds the engine idle since longer than a call. Where callers
do not come back (independent requests, which a wait cannot merge), a wait that got fewer than half
of those it waited for stops the waits for the next ``GATHER_BACKOFF`` calls.

A read waits for the whole call it is in, so with ``max_call_s`` a call takes queued callers only
while the reads it has taken would run about that long at the last calls' seconds per read (and
always one caller). An engine server sets it (``MAX_CALL_S``): it has no admission gate of its own,
and on an engine that reads a row at a time (SmolLM2 behind a gateway on the CPU, ~0.15 s a read)
merging every queued read into one call gained nothing and made each read wait for all of them: the
replica answered whole calls after the gateway's deadlines had passed, for nobody. On an engine whose
forwards batch rows the bound is far off (an H200 reads a W1 call of 96 in ~0.3 s). The in-process
server's gate bounds what it has taken, and its calls are not bounded.

When the wait does not merge them, the two halves are kept even: a call takes at most half of the
callers active at once (once there are ``BALANCE_FROM`` of them), unless all of them are queued; the
rest wait for the next call, with the callers coming back from this one. Left to themselves, the
halves keep whatever sizes they started with: W1 at concurrency 32 on an H200 settled into calls of 12
and 20 decisions, and a call of 20 pays for 24 rows (the engine's CUDA graph buckets: 12, 16, 24, 32)
while two calls of 16 pay for 16 each (bench/RESULTS.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from slotread.engines.base import Engine, Family, ReadRequest, SlotScores
from slotread.engines.thought import Thinker, ThoughtRequest, can_think
from slotread.errors import ReadAbandoned

#: how long a call may wait for callers to queue: this share of the last call's time, and at most MAX_GATHER_S
GATHER_SHARE = 0.1
MAX_GATHER_S = 0.05
#: the calls that start without a wait after a wait that got fewer than half of the callers it waited for
GATHER_BACKOFF = 16
#: the callers active at once from which a call takes at most half of them (below it, a call reads
#: whatever is queued: a small call costs about what a smaller one does)
BALANCE_FROM = 8
#: an engine server's ``max_call_s``: seconds of reads (at the last calls' seconds per read) a call takes
#: at most, beyond its first caller
MAX_CALL_S = 1.0


@dataclass(eq=False)
class _Job:
    """One caller's reads or thoughts and, once run, their results or the exception. ``ready`` is set
    when they are finished, or when the caller is to run the next batch itself."""

    thinks: bool
    requests: list[Any]
    #: whether nobody waits for the results any more
    abandoned: Callable[[], bool] | None = None
    results: list[Any] | None = None
    error: BaseException | None = None
    finished: bool = field(default=False)
    ready: threading.Event = field(default_factory=threading.Event)


class BatchingEngine:
    """An ``Engine`` that serialises and merges concurrent ``read`` and ``think`` calls to ``engine``."""

    def __init__(
        self,
        engine: Engine,
        observe: Callable[[int, float], None] | None = None,
        max_wait_s: float | None = None,
        max_call_s: float | None = None,
    ) -> None:
        self.engine = engine
        #: called after every engine read call with its number of reads and its seconds (metrics)
        self._observe = observe
        #: the longest a call waits for callers to queue (``_gather``); None: a tenth of the last call's time, at
        #: most MAX_GATHER_S
        self._max_wait_s = max_wait_s
        #: seconds of reads a call takes at most beyond its first caller; None: no bound
        self._max_call_s = max_call_s
        self.family: Family = engine.family
        self.noisy = engine.noisy
        self.max_tokens = engine.max_tokens
        self.deterministic = engine.deterministic
        #: the engine's image reader, if it reads images (``engines.base.vision_of``)
        self.vision = getattr(engine, "vision", None)
        #: whether the wrapped engine writes thoughts (``engines.thought.can_think``)
        self.thinks = can_think(engine)
        self._pending: list[_Job] = []
        self._running = 0  # jobs in the engine call under way
        self._most = 0  # the most jobs waiting or running at once since the last call began
        self._last_call_s = 0.0  # how long the last engine call took, and when it ended
        self._ended = 0.0
        self._read_s: float | None = None  # running mean of the seconds per read of the read calls
        self._skip = 0  # calls left to start without a wait (``GATHER_BACKOFF``)
        self._busy = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="slotread-engine")  # runs every engine call
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # notified whenever a job is queued

    @property
    def pending(self) -> int:
        """Reads and thoughts waiting for the engine to be free."""
        with self._lock:
            return sum(len(job.requests) for job in self._pending)

    def read(self, requests: list[ReadRequest], abandoned: Callable[[], bool] | None = None) -> list[SlotScores]:
        """Read ``requests``, possibly in one engine call with other threads' reads; raises ReadAbandoned,
        without reading them, if ``abandoned()`` says so when their call would start."""
        scores: list[SlotScores] = self._submit(_Job(False, list(requests), abandoned))
        return scores

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """The wrapped engine's thoughts for ``requests``, possibly in one call with other threads' thoughts."""
        if not self.thinks:
            raise ValueError(f"the {type(self.engine).__name__} writes no thoughts")
        thoughts: list[tuple[int, ...]] = self._submit(_Job(True, list(requests)))
        return thoughts

    def _submit(self, job: _Job) -> list[Any]:
        with self._lock:
            self._pending.append(job)
            self._most = max(self._most, len(self._pending) + self._running)
            self._queued.notify()
            leads = not self._busy
            self._busy = True
        if not leads:
            # Woken once: the job is finished, or the engine is free and this job is the first queued.
            job.ready.wait()
        if not job.finished:
            self._lead()
        if job.error is not None:
            raise job.error
        assert job.results is not None
        return job.results

    def _lead(self) -> None:
        """Run what is queued (``_share`` says how much; the caller's job is the first) in one batch,
        then wake its callers and hand the engine to the first job still queued. Waking only those (not
        every waiting thread after every engine call) keeps tens of decision threads from contending
        for the GIL with the engine's."""
        with self._lock:
            self._gather()
            take = self._share()
            batch, self._pending = self._pending[:take], self._pending[take:]
            self._running = len(batch)
            self._most = len(batch) + len(self._pending)
        try:
            for job in batch:
                if job.abandoned is not None and job.abandoned():
                    job.error, job.finished = ReadAbandoned("the read's caller left before the engine got to it"), True
            reads = [job for job in batch if not job.thinks and not job.finished]
            if reads:
                self._run(reads)
            thoughts = [job for job in batch if job.thinks]
            for group in [[job] for job in thoughts] if self.deterministic else [thoughts]:
                if group:
                    self._run(group)
        finally:
            with self._lock:
                self._running, self._ended = 0, time.monotonic()
                successor = self._pending[0] if self._pending else None
                self._busy = successor is not None
            if successor is not None:  # first: the engine's next call need not wait for this one's callers
                successor.ready.set()
            for job in batch:
                if not job.finished:  # the batch was interrupted (a BaseException): its callers must not wait
                    job.error, job.finished = RuntimeError("the engine call was interrupted"), True
                job.ready.set()

    def _gather(self) -> None:
        """Wait, the lock held, until as many jobs are queued as were waiting or running at once during
        the last call (its callers, answered, ask again), or until the wait is over; not after the
        engine sat idle for longer than that call, nor for a while after a wait that got fewer than
        half of those it waited for (the module docstring says why)."""
        now = time.monotonic()
        if now - self._ended > self._last_call_s or len(self._pending) >= self._most:
            return
        if self._skip:
            self._skip -= 1
            return
        wait = self._max_wait_s
        if wait is None:
            wait = min(MAX_GATHER_S, GATHER_SHARE * self._last_call_s)
        deadline, queued = now + wait, len(self._pending)
        while len(self._pending) < self._most and (left := deadline - time.monotonic()) > 0:
            self._queued.wait(left)
        if 2 * (len(self._pending) - queued) < self._most - queued:
            self._skip = GATHER_BACKOFF

    def _share(self) -> int:
        """How many of the queued jobs the next call takes: all of them, or, while others are still
        on their way back from the last call, at most half of the callers active at once (the
        module docstring says why; not after the engine sat idle for longer than the last call); and
        no more than ``max_call_s`` of reads beyond the first job."""
        queued = len(self._pending)
        idle = time.monotonic() - self._ended > self._last_call_s
        take = queued if idle or self._most < BALANCE_FROM or queued >= self._most else min(queued, -(-self._most // 2))
        if self._max_call_s is None or self._read_s is None:
            return take
        reads = len(self._pending[0].requests)
        for index in range(1, take):
            reads += len(self._pending[index].requests)
            if reads * self._read_s > self._max_call_s:
                return index
        return take

    def _run(self, batch: list[_Job]) -> None:
        """Run ``batch`` (all reads or all thoughts) in one engine call; if it raises, each job alone."""
        merged = [request for job in batch for request in job.requests]
        try:
            if batch[0].thinks:
                assert isinstance(self.engine, Thinker)
                results: list[Any] = self._thread.submit(self.engine.think, merged).result()
            else:
                results = self._thread.submit(self._read, merged).result()
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error, batch[0].finished = exc, True
                return
            for job in batch:
                self._run([job])
            return
        start = 0
        for job in batch:
            job.results = results[start : start + len(job.requests)]
            job.finished = True
            start += len(job.requests)

    def _read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One engine read call, timed (in the engine's thread)."""
        started = time.monotonic()
        try:
            scores: list[SlotScores] = self.engine.read(requests)
            return scores
        finally:
            self._last_call_s = time.monotonic() - started
            per_read = self._last_call_s / max(1, len(requests))
            self._read_s = per_read if self._read_s is None else 0.8 * self._read_s + 0.2 * per_read
            if self._observe is not None:
                self._observe(len(requests), self._last_call_s)
