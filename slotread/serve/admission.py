"""The admission gate: at most ``slots`` decisions run, at most ``queue_size`` wait, the rest are refused.

Refusing at once (529 with retry-after) keeps latency bounded under overload instead of letting a
queue grow past the client's timeout. The deadline is for the whole answer. Decisions differ in size
(a request's ``cost``: its questions), so the gate keeps the recent mean seconds a decision holds its
slot per unit of cost, and the mean cost: a request is refused at once when its expected wait (the
cost queued before it plus one mean decision, at that rate, over the slots) plus its own hold would
pass the deadline, and a waiting request gives up, with a 529, as soon as getting its slot could no
longer finish in time. A one-question request after 64-question ones is not refused for their size.
On a slow machine a short queue is already too long, and this holds latency under the deadline
anyway. A waiting request whose client disconnects leaves the queue silently, so dead requests
never reach the model.
Waiters are served by ``priority`` (lower first, vLLM's convention), then in arrival order.

The gate lives on the event loop: it is not thread-safe and needs none of that.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from slotread.errors import Overloaded

#: how often a waiting request checks whether its client is still there
_DISCONNECT_POLL_S = 0.05
#: weight of the newest hold time in the running mean (about the last ten decisions count)
_HOLD_WEIGHT = 0.2


class ClientGone(Exception):
    """The client disconnected while its request waited; nobody is left to answer."""


class AdmissionGate:
    """Hands out decision slots; ``waiting`` and ``running`` are exposed for metrics."""

    def __init__(self, slots: int, queue_size: int, retry_after_s: float) -> None:
        self.slots = slots
        self.queue_size = queue_size
        self.retry_after_s = retry_after_s
        self.running = 0
        self._queue: list[tuple[int, int, asyncio.Future[None], float]] = []  # heap: (priority, arrival, grant, cost)
        self._arrivals = itertools.count()
        #: running mean of the seconds a decision holds its slot per unit of cost; None until one has finished
        self.hold_per_cost_s: float | None = None
        #: running mean of the cost of the decisions that held a slot; None until one has finished
        self.mean_cost: float | None = None

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    def hold_s(self, cost: float) -> float:
        """How long a decision of ``cost`` is expected to hold its slot (0 before any has finished)."""
        return 0.0 if self.hold_per_cost_s is None else cost * self.hold_per_cost_s

    def expected_wait_s(self) -> float:
        """How long a request arriving now would wait for a slot: the cost queued, and one mean decision
        for those running, at the recent rate, over the slots."""
        queued = sum(cost for *_, cost in self._queue)
        return self.hold_s(queued + (self.mean_cost or 1.0)) / self.slots

    @asynccontextmanager
    async def slot(
        self, deadline_s: float, disconnected: Callable[[], Awaitable[bool]], priority: int = 0, cost: float = 1.0
    ) -> AsyncIterator[None]:
        """Hold a decision slot for the ``async with`` body, for a decision of ``cost``.

        Raises Overloaded when the queue is full or the answer could not be ready within
        ``deadline_s``; ClientGone when the client leaves first.
        """
        if self.running < self.slots and not self._queue:
            self.running += 1
        elif len(self._queue) >= self.queue_size:
            raise Overloaded(
                f"the server is at capacity ({self.slots} running, {self.waiting} queued)", self.retry_after_s
            )
        elif self.expected_wait_s() + self.hold_s(cost) > deadline_s:
            message = f"the expected time to answer is longer than the deadline of {deadline_s:g} s"
            raise Overloaded(message, self.retry_after_s)
        else:
            await self._wait(deadline_s, disconnected, priority, cost)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            yield
        finally:
            rate = (loop.time() - started) / cost
            self.hold_per_cost_s = _mean(self.hold_per_cost_s, rate)
            self.mean_cost = _mean(self.mean_cost, cost)
            self._release()

    async def _wait(
        self, deadline_s: float, disconnected: Callable[[], Awaitable[bool]], priority: int, cost: float
    ) -> None:
        grant: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), grant, cost)
        heapq.heappush(self._queue, entry)
        loop = asyncio.get_running_loop()
        answer_by = loop.time() + deadline_s
        try:
            while not grant.done():
                # Recomputed every poll: the first hold times arrive while the first requests wait.
                left = answer_by - self.hold_s(cost) - loop.time()
                if left <= 0:
                    message = f"no decision slot freed up in time to answer within {deadline_s:g} s"
                    raise Overloaded(message, self.retry_after_s)
                await asyncio.wait({grant}, timeout=min(left, _DISCONNECT_POLL_S))
                if not grant.done() and await disconnected():
                    raise ClientGone
            if loop.time() + self.hold_s(cost) > answer_by:
                # The slot came, but too late to finish in time (the first hold times can show that only now).
                raise Overloaded(
                    f"a decision slot freed up too late to answer within {deadline_s:g} s", self.retry_after_s
                )
        except BaseException:
            if grant.done() and not grant.cancelled():
                self._release()  # granted, but we are not taking it: pass the slot on
            else:
                grant.cancel()
                self._queue.remove(entry)
                heapq.heapify(self._queue)
            raise

    def _release(self) -> None:
        """Give the slot to the first waiter still waiting, or free it."""
        while self._queue:
            _, _, grant, _ = heapq.heappop(self._queue)
            if not grant.done():
                grant.set_result(None)
                return
        self.running -= 1


def _mean(mean: float | None, value: float) -> float:
    """The running mean after ``value`` (about the last ten values count)."""
    return value if mean is None else (1 - _HOLD_WEIGHT) * mean + _HOLD_WEIGHT * value
