"""The admission gate: at most ``slots`` decisions run, at most ``queue_size`` wait, the rest are refused.

Refusing at once (529 with retry-after) keeps latency bounded under overload instead of letting a
queue grow past the client's timeout. The deadline is for the whole answer. Decisions differ in size
(a request's ``cost``: its questions), so the gate measures its **rate**: the cost of the decisions
answered over the last ``WINDOW_S`` seconds (or two mean holds, if longer) in which it was busy. A
request is refused at once when everything ahead of it (the cost running and queued) and its own
cost, at that rate, would be answered after ``ADMIT_SHARE`` of its deadline (the rate is a mean, not
a promise), whether or not a slot is free: a gateway's slots are many and its replicas may be few or
slow, so a free slot promises nothing. Only an idle server takes any request; before a gateway's
first answer (no rate yet) ``SLOW_START`` decisions per replica run at once. Decisions that time
out count as busy time without an answer, so a server that has fallen behind sees its rate fall and
takes less. A waiting request gives up, with a 529, as soon as getting its slot could no longer
finish in time (judged by the mean hold per unit of cost). A one-question request after 64-question
ones is not refused for their size. A waiting request whose client disconnects leaves the queue
silently, so dead requests never reach the model.

A refusal's retry-after is when the work ahead of it, and that of the requests refused before it,
will have drained to ``BOOK_SHARE`` of its deadline (at least ``retry_after_s``, at most a minute),
and that much is booked for it then (within ``BOOKING_HORIZON`` deadlines), under the request's
``key`` (a digest of its body: a client resends the same request). A newcomer counts every booking
ahead of it; a request back to its own booking takes it and counts none. So requests refused
together are told to come back one after another, each to room kept for it, not all at the next
second to be refused again (32 clients against one CPU replica that could take 18 got most of their
decisions refused on every try so).
Waiters are served by ``priority`` (lower first, vLLM's convention), then in arrival order.

The rate is per unit of ``capacity``: a gateway's replicas in rotation (``track_capacity``), else 1.
When a replica leaves the rotation the rate the gate expects drops with it at once, before slower
decisions have taught it so.

The gate lives on the event loop: it is not thread-safe and needs none of that.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager

from slotread.errors import Overloaded

#: how often a waiting request checks whether its client is still there
_DISCONNECT_POLL_S = 0.05
#: weight of the newest hold time in the running means (about the last ten decisions count)
_HOLD_WEIGHT = 0.2
#: the longest retry-after a refusal gives: the SDKs ignore longer ones
_MAX_RETRY_AFTER_S = 60.0
#: the busy seconds the rate is measured over, at least (or two mean holds, where those are longer)
WINDOW_S = 5.0
#: how far ahead, in deadlines, a refused request is booked: further out, a client has likely given up
#: (the SDK stops when a retry-after would pass its 30 s budget) and its booking would keep room for
#: nobody; a request refused then is told the wait, and booked nothing (booked without a bound, a soak
#: whose clients gave up piled up bookings until every request was refused for a minute)
BOOKING_HORIZON = 2.0
#: a booking is dropped once this late: the SDKs wait retry-after-ms to the millisecond, and a client
#: that gave up never comes back
_BOOKING_GRACE_S = 1.0
#: a gateway's decisions running at once per replica before any was answered (the rate is unknown): one
#: that let 31 decisions through at once to a CPU replica that answers 3 a second saw most of them time
#: out, and their clients told to come back 20 s later. An in-process server has none: its batcher
#: merges whatever runs into its engine's calls (a fresh GPU server takes a burst of 32 at once)
SLOW_START = 4
#: the share of its deadline within which a request must be expected to be answered to be taken: the
#: expectation is a mean, and a decision answered past its deadline is work lost (a gateway's replicas
#: computed it for nobody)
ADMIT_SHARE = 0.75
#: a refused request is booked for when the work ahead will have drained to this share of its deadline:
#: below ``ADMIT_SHARE``, so it finds room though the rate dipped or those booked before it came back
#: together (booked at ``ADMIT_SHARE``, a third of those coming back were refused again)
BOOK_SHARE = 0.5


class ClientGone(Exception):
    """The client disconnected while its request waited; nobody is left to answer."""


class AdmissionGate:
    """Hands out decision slots; ``waiting`` and ``running`` are exposed for metrics."""

    def __init__(self, slots: int, queue_size: int, retry_after_s: float) -> None:
        self.slots = slots
        self.queue_size = queue_size
        self.retry_after_s = retry_after_s
        self.running = 0
        #: the cost of the decisions holding a slot
        self.running_cost = 0.0
        self._queue: list[tuple[int, int, asyncio.Future[None], float]] = []  # heap: (priority, arrival, grant, cost)
        self._arrivals = itertools.count()
        #: running mean of the seconds a decision holds its slot per unit of cost; None until one has finished
        self.hold_per_cost_s: float | None = None
        #: running mean of the seconds a decision holds its slot; None until one has finished
        self._hold_s: float | None = None
        self._capacity: Callable[[], int] = lambda: 1
        #: decisions let run at once before the first answer (``SLOW_START`` per unit of tracked capacity)
        self._slow_start: Callable[[], float] = lambda: math.inf
        #: seconds during which a decision held a slot, up to ``_busy_to`` (the loop's time)
        self._busy_s = 0.0
        self._busy_to = 0.0
        #: the decisions answered within the window: (``_busy_s`` then, their cost per unit of capacity)
        self._answered: deque[tuple[float, float]] = deque()
        self._answered_cost = 0.0
        self._ever_answered = False
        #: (loop time, cost, key) booked for each refused request to come back then, in time order
        self._booked: list[tuple[float, float, Hashable]] = []

    def track_capacity(self, capacity: Callable[[], int]) -> None:
        """Scale the expected rate by ``capacity()`` from now on (a gateway: its replicas in rotation).
        With none, the requests are let through to find that out for themselves (a 503 at once). Before
        the first answer, ``SLOW_START`` decisions per unit of capacity run at once."""
        self._capacity = capacity
        self._slow_start = lambda: SLOW_START * max(1, capacity())

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    def hold_s(self, cost: float) -> float:
        """How long a decision of ``cost`` is expected to hold its slot (0 before any has finished)."""
        return 0.0 if self.hold_per_cost_s is None else cost * self.hold_per_cost_s

    @property
    def rate_per_capacity(self) -> float | None:
        """Cost answered per busy second per unit of capacity over the window; None before any answer."""
        if not self._ever_answered:
            return None
        self._advance()
        start = max(0.0, self._busy_s - max(WINDOW_S, 2 * (self._hold_s or 0.0)))
        while self._answered and self._answered[0][0] <= start:
            self._answered_cost -= self._answered.popleft()[1]
        span = self._busy_s - start
        return max(0.0, self._answered_cost) / span if span > 0 else None

    def expected_s(self, cost: float, booked: float = 0.0) -> float:
        """How long a request of ``cost`` arriving now is expected to take to answer: the cost running,
        queued and ``booked`` ahead of it, and its own, at the recent rate (0 before any decision was
        answered; infinite when none was for the window's time)."""
        rate = self.rate_per_capacity
        if rate is None:
            return 0.0
        queued = sum(entry[3] for entry in self._queue)
        total = rate * max(1, self._capacity())
        return (self.running_cost + queued + booked + cost) / total if total > 0 else math.inf

    def refusal(
        self, message: str, deadline_s: float, cost: float, key: Hashable = None, ahead: float | None = None
    ) -> Overloaded:
        """A 529 for a request of ``cost`` whose retry-after is when the work ahead of it (``ahead``: the
        cost booked for the requests refused before it; None: all that is booked) will have drained to
        ``BOOK_SHARE`` of its deadline (at least ``retry_after_s``, at most a minute); that much is booked
        for it then, under ``key`` (the request, which a client sends again as it was), unless that is
        more than ``BOOKING_HORIZON`` deadlines away."""
        now = asyncio.get_running_loop().time()
        booked = sum(booking[1] for booking in self._booked) if ahead is None else ahead
        wait = self.expected_s(cost, booked) - BOOK_SHARE * deadline_s
        retry = min(_MAX_RETRY_AFTER_S, max(self.retry_after_s, wait))
        if retry <= BOOKING_HORIZON * deadline_s:
            bisect.insort(self._booked, (now + retry, cost, key), key=lambda booking: booking[0])
        return Overloaded(message, retry)

    def _booked_ahead(self, now: float, key: Hashable) -> float:
        """The cost booked ahead of a request arriving now: all of it, or none when ``key`` comes back
        to its own booking (which it takes: the room was kept for it). Bookings late past
        ``_BOOKING_GRACE_S`` are dropped: their clients gave up."""
        self._booked = [booking for booking in self._booked if booking[0] >= now - _BOOKING_GRACE_S]
        for index, booking in enumerate(self._booked):
            if key is not None and booking[2] == key:
                del self._booked[index]
                return 0.0
        return sum(booking[1] for booking in self._booked)

    @asynccontextmanager
    async def slot(
        self,
        deadline_s: float,
        disconnected: Callable[[], Awaitable[bool]],
        priority: int = 0,
        cost: float = 1.0,
        key: Hashable = None,
    ) -> AsyncIterator[None]:
        """Hold a decision slot for the ``async with`` body, for a decision of ``cost``; ``key`` names the
        request (a digest of its body), so one refused and sent again finds its booking.

        Raises Overloaded when the queue is full or the answer could not be ready within
        ``deadline_s``; ClientGone when the client leaves first.
        """
        booked = self._booked_ahead(asyncio.get_running_loop().time(), key)
        direct = self.running < self.slots and not self._queue
        if not direct and len(self._queue) >= self.queue_size:
            message = f"the server is at capacity ({self.slots} running, {self.waiting} queued)"
            raise self.refusal(message, deadline_s, cost, key, booked)
        if self.rate_per_capacity is None and self.running >= self._slow_start():
            message = f"the server has answered nothing yet, and {self.running} decisions are under way"
            raise self.refusal(message, deadline_s, cost, key, booked)
        expected = self.expected_s(cost, booked)
        if self.running and expected > ADMIT_SHARE * deadline_s:  # an idle server takes any request
            message = (
                f"the expected time to answer, {expected:.1f} s, is longer than {ADMIT_SHARE:.0%} of the "
                f"deadline of {deadline_s:g} s"
            )
            raise self.refusal(message, deadline_s, cost, key, booked)
        if direct:
            self.running += 1
        else:
            await self._wait(deadline_s, disconnected, priority, cost, key)
        loop = asyncio.get_running_loop()
        self._add_running(cost)
        started = loop.time()
        try:
            yield
        except Overloaded:  # the replicas did not answer by the deadline: busy time, nothing answered
            self._learn(loop.time() - started, cost, answered=False)
            raise
        else:  # only a decision answered counts: one refused as malformed in a millisecond says nothing
            self._learn(loop.time() - started, cost, answered=True)
        finally:
            self._add_running(-cost)
            self._release()

    def _advance(self) -> None:
        """Count the busy time up to now."""
        now = asyncio.get_running_loop().time()
        if self.running_cost > 0:
            self._busy_s += now - self._busy_to
        self._busy_to = now

    def _add_running(self, cost: float) -> None:
        self._advance()
        self.running_cost += cost

    def _learn(self, hold: float, cost: float, answered: bool) -> None:
        """Update the means with a decision of ``cost`` that held its slot ``hold`` seconds, and the
        rate's window with it if it was answered."""
        self.hold_per_cost_s = _mean(self.hold_per_cost_s, hold / cost)
        self._hold_s = _mean(self._hold_s, hold)
        if answered:
            self._advance()
            share = cost / max(1, self._capacity())
            self._answered.append((self._busy_s, share))
            self._answered_cost += share
            self._ever_answered = True

    async def _wait(
        self, deadline_s: float, disconnected: Callable[[], Awaitable[bool]], priority: int, cost: float, key: Hashable
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
                    raise self.refusal(message, deadline_s, cost, key)
                await asyncio.wait({grant}, timeout=min(left, _DISCONNECT_POLL_S))
                if not grant.done() and await disconnected():
                    raise ClientGone
            if loop.time() + self.hold_s(cost) > answer_by:
                # The slot came, but too late to finish in time (the first hold times can show that only now).
                message = f"a decision slot freed up too late to answer within {deadline_s:g} s"
                raise self.refusal(message, deadline_s, cost, key)
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
