"""Merge the reads of concurrent decisions into one engine batch, one engine call at a time.

The server runs several decisions in worker threads; each calls ``Engine.read`` for its stages.
``BatchingEngine`` wraps the model's engine and lets one call run at a time (the engines' prefix
caches are not thread-safe), and a thread that finds the engine free reads everything queued
meanwhile in one batch. Batching across requests changes no answer beyond the engine's tolerance
(``engines/base.py``): on the CPU the causal engine's answers are bit-identical in any batch.

If a merged batch raises, every request of it is read again alone, so one failing read cannot fail
its neighbours' decisions. Thoughts (``x_think``) are generated with the engine to themselves, one call
at a time, between merged reads; they are not merged across decisions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from slotread.engines.base import Engine, Family, ReadRequest, SlotScores
from slotread.engines.thought import Thinker, ThoughtRequest


@dataclass(eq=False)
class _Job:
    """One caller's reads and, once read, their scores or the exception."""

    requests: list[ReadRequest]
    scores: list[SlotScores] | None = None
    error: BaseException | None = None
    finished: bool = field(default=False)


class BatchingEngine:
    """An ``Engine`` that serialises and merges concurrent ``read`` calls to ``engine``."""

    def __init__(self, engine: Engine, observe: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        #: called with the number of reads of every engine call (metrics)
        self._observe = observe
        self.family: Family = engine.family
        self.noisy = engine.noisy
        self.max_tokens = engine.max_tokens
        self.deterministic = engine.deterministic
        #: the engine's image reader, if it reads images (``engines.base.vision_of``)
        self.vision = getattr(engine, "vision", None)
        #: whether the wrapped engine writes thoughts (``engines.thought.can_think``)
        self.thinks = isinstance(engine, Thinker)
        self._pending: list[_Job] = []
        self._busy = False
        self._changed = threading.Condition()

    @property
    def pending(self) -> int:
        """Reads waiting for the engine to be free."""
        with self._changed:
            return sum(len(job.requests) for job in self._pending)

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """Read ``requests``, possibly in one engine call with other threads' reads."""
        job = _Job(list(requests))
        batch: list[_Job] = []
        with self._changed:
            self._pending.append(job)
            while self._busy and not job.finished:
                self._changed.wait()
            if not job.finished:
                # The engine is free and this job is still queued: read everything queued, this job included.
                batch, self._pending = self._pending, []
                self._busy = True
        if batch:
            try:
                self._run(batch)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
        if job.error is not None:
            raise job.error
        assert job.scores is not None
        return job.scores

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """The wrapped engine's thoughts for ``requests``, once the engine is free (no read runs meanwhile)."""
        if not isinstance(self.engine, Thinker):
            raise ValueError(f"the {type(self.engine).__name__} writes no thoughts")
        with self._changed:
            while self._busy:
                self._changed.wait()
            self._busy = True
        try:
            return self.engine.think(requests)
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()

    def _run(self, batch: list[_Job]) -> None:
        merged = [request for job in batch for request in job.requests]
        if self._observe is not None:
            self._observe(len(merged))
        try:
            scores = self.engine.read(merged)
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error, batch[0].finished = exc, True
                return
            for job in batch:
                self._run([job])
            return
        start = 0
        for job in batch:
            job.scores = scores[start : start + len(job.requests)]
            job.finished = True
            start += len(job.requests)
