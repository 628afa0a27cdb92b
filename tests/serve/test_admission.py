"""The admission gate: slots, a bounded queue, deadlines, disconnects and priorities (no model)."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from slotread.errors import Overloaded
from slotread.serve.admission import ADMIT_SHARE, BOOK_SHARE, BOOKING_HORIZON, SLOW_START, AdmissionGate, ClientGone


async def connected() -> bool:
    return False


async def hold(gate: AdmissionGate, release: asyncio.Event, order: list[str], name: str, **options: object) -> None:
    disconnected: Callable[[], Awaitable[bool]] = options.pop("disconnected", connected)  # type: ignore[assignment]
    deadline, priority, cost, key = (
        float(options.pop("deadline", 5.0)),
        int(options.pop("priority", 0)),
        options.pop("cost", 1),
        options.pop("key", None),
    )  # type: ignore[arg-type]
    async with gate.slot(deadline, disconnected, priority, float(cost), key):  # type: ignore[arg-type]
        order.append(name)
        await release.wait()


async def answer_four_in(gate: AdmissionGate, seconds: float) -> None:
    """Teach ``gate`` a rate: 4 one-cost decisions held together for ``seconds``, then answered."""
    release, order = asyncio.Event(), []
    first = [asyncio.create_task(hold(gate, release, order, f"f{i}")) for i in range(4)]
    await asyncio.sleep(seconds)
    release.set()
    await asyncio.gather(*first)


def test_a_full_queue_refuses_at_once_and_freed_slots_go_to_waiters_in_order() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=2, queue_size=2, retry_after_s=1.5)
        release, order = asyncio.Event(), []
        tasks = [asyncio.create_task(hold(gate, release, order, f"r{i}")) for i in range(4)]
        await asyncio.sleep(0.05)
        assert (gate.running, gate.waiting, order) == (2, 2, ["r0", "r1"])
        with pytest.raises(Overloaded) as caught:
            async with gate.slot(5.0, connected):
                pass
        assert caught.value.retry_after == 1.5
        release.set()
        await asyncio.gather(*tasks)
        assert order == ["r0", "r1", "r2", "r3"]
        assert (gate.running, gate.waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_waiter_past_its_deadline_is_refused_and_leaves_the_queue() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=4, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        holder = asyncio.create_task(hold(gate, release, order, "holder"))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            await hold(gate, release, order, "late", deadline=0.1)
        assert gate.waiting == 0
        release.set()
        await holder
        assert order == ["holder"] and gate.running == 0

    asyncio.run(scenario())


def test_a_client_that_disconnects_while_queued_frees_its_place() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=1, retry_after_s=1.0)
        release, order, gone = asyncio.Event(), [], asyncio.Event()

        async def disconnected() -> bool:
            return gone.is_set()

        holder = asyncio.create_task(hold(gate, release, order, "holder"))
        await asyncio.sleep(0.01)
        leaver = asyncio.create_task(hold(gate, release, order, "leaver", disconnected=disconnected))
        await asyncio.sleep(0.01)
        assert gate.waiting == 1
        gone.set()
        with pytest.raises(ClientGone):
            await leaver
        assert gate.waiting == 0
        stayer = asyncio.create_task(hold(gate, release, order, "stayer"))  # the freed queue place is usable
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(holder, stayer)
        assert order == ["holder", "stayer"] and gate.running == 0

    asyncio.run(scenario())


def test_waiters_are_served_by_priority_then_arrival() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=8, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        tasks = [asyncio.create_task(hold(gate, release, order, "first"))]
        await asyncio.sleep(0.01)
        for name, priority in [("low-a", 5), ("high", -1), ("normal", 0), ("low-b", 5)]:
            tasks.append(asyncio.create_task(hold(gate, release, order, name, priority=priority)))
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*tasks)
        assert order == ["first", "high", "normal", "low-a", "low-b"]

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_no_trace() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=2, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        holder = asyncio.create_task(hold(gate, release, order, "holder"))
        await asyncio.sleep(0.01)
        waiter = asyncio.create_task(hold(gate, release, order, "waiter"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        release.set()
        await holder
        assert (gate.running, gate.waiting, order) == (0, 0, ["holder"])

    asyncio.run(scenario())


def test_an_answer_expected_after_the_deadline_is_refused_at_once() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=8, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        first = asyncio.create_task(hold(gate, release, order, "first"))
        await asyncio.sleep(0.2)
        release.set()
        await first  # one decision held its slot for about 0.2 s
        assert gate.hold_per_cost_s is not None and 0.15 < gate.hold_per_cost_s < 1.0
        release.clear()
        busy = asyncio.create_task(hold(gate, release, order, "busy"))
        await asyncio.sleep(0.01)
        deadline = 0.7 / ADMIT_SHARE  # requests expected within 0.7 s are taken
        waiting = [asyncio.create_task(hold(gate, release, order, f"w{i}", deadline=deadline)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 2  # expected answers in about 0.2 + 0.2 s and 0.4 + 0.2 s: queued
        started = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded, match="expected time to answer"):
            await hold(gate, release, order, "late", deadline=deadline)  # about 0.6 + 0.2 s: refused at once
        assert asyncio.get_running_loop().time() - started < 0.1
        release.set()
        await asyncio.gather(busy, *waiting)

    asyncio.run(scenario())


def test_a_slot_that_comes_too_late_to_finish_in_time_is_passed_on() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=8, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        first = asyncio.create_task(hold(gate, release, order, "first"))  # no hold time known yet
        await asyncio.sleep(0.01)
        late = asyncio.create_task(hold(gate, release, order, "late", deadline=0.8))
        await asyncio.sleep(0.5)
        release.set()  # first held 0.5 s; late would answer after about 0.5 + 0.5 > 0.8 s
        await first
        with pytest.raises(Overloaded, match="too late"):
            await late
        assert (gate.running, gate.waiting, order) == (0, 0, ["first"])

    asyncio.run(scenario())


def test_a_small_request_after_large_ones_is_queued_not_refused() -> None:
    """Holds are predicted per unit of cost: after 8-question decisions of 0.2 s each, a 1-question one
    is expected to wait for one mean (8-question) decision and hold 0.025 s: about 0.23 s, within 0.3 s,
    where a mean hold per decision would have predicted 0.2 + 0.2 s and refused it. Another 8-question
    one behind it would answer after about 0.2 + 0.025 + 0.2 s: refused."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=1, queue_size=8, retry_after_s=1.0)
        release, order = asyncio.Event(), []
        for name in ("big1", "big2"):
            task = asyncio.create_task(hold(gate, release, order, name, cost=8))
            await asyncio.sleep(0.2)
            release.set()
            await task
            release.clear()
        assert gate.hold_per_cost_s is not None and 0.015 < gate.hold_per_cost_s < 0.1
        busy = asyncio.create_task(hold(gate, release, order, "big3", cost=8))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(hold(gate, release, order, "small", cost=1, deadline=0.3 / ADMIT_SHARE))
        await asyncio.sleep(0.01)
        assert gate.waiting == 1  # queued, not refused
        with pytest.raises(Overloaded, match="expected time to answer"):
            await hold(gate, release, order, "big4", cost=8, deadline=0.3 / ADMIT_SHARE)
        release.set()
        await asyncio.gather(busy, small)
        assert order[-2:] == ["big3", "small"]

    asyncio.run(scenario())


def test_a_free_slot_is_not_taken_when_the_work_ahead_would_pass_the_deadline() -> None:
    """A gateway's slots are many and its replicas few: after 4 decisions that held 0.2 s together (a rate
    of about 20 per second), taking what is expected within 5.5 / rate, the fifth running one expects
    5 / rate: taken; a sixth expects 6 / rate: refused though slots are free, with a retry-after saying
    when the work ahead will have drained to BOOK_SHARE of its deadline. An idle server takes anything."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=64, queue_size=0, retry_after_s=0.001)
        release, order = asyncio.Event(), []
        await answer_four_in(gate, 0.2)
        rate = gate.rate_per_capacity
        assert rate is not None and 15 < rate < 21  # 4 answered in 0.2 busy seconds
        deadline = 5.5 / rate / ADMIT_SHARE
        running = [asyncio.create_task(hold(gate, release, order, f"r{i}", deadline=deadline)) for i in range(6)]
        await asyncio.sleep(0.01)
        assert gate.running == 5
        with pytest.raises(Overloaded, match="expected time to answer") as caught:
            await running[5]
        # when the 6 / rate ahead will have drained to BOOK_SHARE of the deadline (busy time went on meanwhile)
        assert caught.value.retry_after == pytest.approx(6 / rate - BOOK_SHARE * deadline, rel=0.2)
        release.set()
        await asyncio.gather(*running[:5])
        assert gate.running == 0 and gate.running_cost == 0
        release.clear()
        alone = asyncio.create_task(hold(gate, release, order, "alone", cost=100, deadline=deadline))
        await asyncio.sleep(0.01)
        assert gate.running == 1  # idle: taken, though expected to take longer than its deadline
        release.set()
        await alone

    asyncio.run(scenario())


def test_the_expected_rate_follows_the_capacity_at_once() -> None:
    """A gateway's rate is per replica in rotation: one of two gone halves it before any decision shows it."""

    async def scenario() -> None:
        replicas = [2]
        gate = AdmissionGate(slots=64, queue_size=0, retry_after_s=0.001)
        gate.track_capacity(lambda: replicas[0])
        release, order = asyncio.Event(), []
        await answer_four_in(gate, 0.2)
        busy = [asyncio.create_task(hold(gate, release, order, f"b{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        both = gate.expected_s(1.0)
        replicas[0] = 1
        assert gate.expected_s(1.0) == pytest.approx(2 * both, rel=0.01)
        with pytest.raises(Overloaded):  # fits the rate of two replicas, not of the one left
            await hold(gate, release, order, "late", deadline=1.5 * both / ADMIT_SHARE)
        replicas[0] = 0  # none: the requests go through, to be answered 503 by the pool at once
        assert gate.expected_s(1.0) == pytest.approx(2 * both, rel=0.1)
        release.set()
        await asyncio.gather(*busy)

    asyncio.run(scenario())


def test_answered_decisions_teach_the_gate_its_rate_and_late_ones_their_hold() -> None:
    """A request refused as malformed leaves its slot in a millisecond: that says nothing. One whose
    replicas did not answer by the deadline held its slot that long, and answered nothing."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=4, queue_size=4, retry_after_s=1.0)
        with pytest.raises(ValueError):
            async with gate.slot(5.0, connected):
                raise ValueError("malformed")
        assert gate.rate_per_capacity is None and gate.hold_per_cost_s is None
        with pytest.raises(Overloaded):
            async with gate.slot(5.0, connected):
                await asyncio.sleep(0.1)
                raise Overloaded("the replicas did not answer by the deadline", 1.0)
        assert gate.hold_per_cost_s is not None and 0.08 < gate.hold_per_cost_s < 0.5
        assert gate.rate_per_capacity is None
        async with gate.slot(5.0, connected, cost=2.0):
            await asyncio.sleep(0.1)
        # 2 answered over 0.2 busy seconds: the late decision's time was busy, and answered nothing
        assert gate.rate_per_capacity is not None and 8 < gate.rate_per_capacity < 10.1
        assert (gate.running, gate.running_cost) == (0, 0)

    asyncio.run(scenario())


def test_requests_refused_together_are_told_to_come_back_one_after_another_to_room_kept_for_them() -> None:
    """With the room full, a refusal books its request a time: after the work ahead and the bookings
    before it, one cost / rate apart. A newcomer counts the bookings; a request back to its own takes
    it and counts none."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=64, queue_size=0, retry_after_s=0.001)
        release, order = asyncio.Event(), []
        await answer_four_in(gate, 0.2)
        rate = gate.rate_per_capacity
        assert rate is not None
        deadline = 6.5 / rate / ADMIT_SHARE  # 6 running fill it
        releases = [asyncio.Event() for _ in range(6)]
        running = [asyncio.create_task(hold(gate, releases[i], order, f"r{i}", deadline=deadline)) for i in range(6)]
        await asyncio.sleep(0.01)
        waits = []
        for key in ("a", "b", "c"):
            with pytest.raises(Overloaded) as caught:
                async with gate.slot(deadline, connected, cost=2.0, key=key):
                    pass
            waits.append(caught.value.retry_after)
        assert waits[1] - waits[0] == pytest.approx(2 / rate, rel=0.25)  # b after a's booking
        assert waits[2] - waits[1] == pytest.approx(2 / rate, rel=0.25)
        for event in releases[:2]:
            event.set()
        await asyncio.gather(*running[:2])  # 4 running: room for 6 / rate' more, not 8 (a's, b's, c's, d's)
        with pytest.raises(Overloaded):
            await hold(gate, asyncio.Event(), order, "d", deadline=deadline, cost=2, key="d")
        release.clear()
        back = asyncio.create_task(hold(gate, release, order, "a", deadline=deadline, cost=2, key="a"))
        await asyncio.sleep(0.01)
        assert gate.running == 5  # back to its booking, it counts neither b's nor c's
        release.set()
        for event in releases:
            event.set()
        await asyncio.gather(back, *running[2:])

    asyncio.run(scenario())


def test_before_any_answer_only_a_few_decisions_run_per_replica() -> None:
    """No rate is known yet: SLOW_START decisions per unit of capacity run, the next is told to come back."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=64, queue_size=64, retry_after_s=0.5)
        gate.track_capacity(lambda: 2)
        release, order = asyncio.Event(), []
        running = [asyncio.create_task(hold(gate, release, order, f"r{i}")) for i in range(2 * SLOW_START)]
        await asyncio.sleep(0.01)
        assert gate.running == 2 * SLOW_START
        with pytest.raises(Overloaded, match="answered nothing yet") as caught:
            await hold(gate, release, order, "next")
        assert caught.value.retry_after == 0.5
        release.set()
        await asyncio.gather(*running)
        assert gate.rate_per_capacity is not None

    asyncio.run(scenario())


def test_an_in_process_gate_takes_a_burst_before_any_answer() -> None:
    """Without tracked capacity (an in-process server, whose batcher merges what runs) there is no slow
    start: a fresh server takes a burst up to its slots."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=32, queue_size=0, retry_after_s=0.5)
        release, order = asyncio.Event(), []
        running = [asyncio.create_task(hold(gate, release, order, f"r{i}")) for i in range(32)]
        await asyncio.sleep(0.01)
        assert gate.running == 32
        release.set()
        await asyncio.gather(*running)

    asyncio.run(scenario())


def test_a_request_told_to_wait_past_the_booking_horizon_books_nothing() -> None:
    """A client told to wait more than BOOKING_HORIZON deadlines has likely given up: room is kept for
    nobody, and those after it are not pushed back by it."""

    async def scenario() -> None:
        gate = AdmissionGate(slots=64, queue_size=0, retry_after_s=0.001)
        release, order = asyncio.Event(), []
        await answer_four_in(gate, 0.2)
        busy = asyncio.create_task(hold(gate, release, order, "busy"))
        await asyncio.sleep(0.01)
        deadline = 0.5
        with pytest.raises(Overloaded) as huge:
            await hold(gate, release, order, "huge", deadline=deadline, cost=100, key="huge")
        assert huge.value.retry_after > BOOKING_HORIZON * deadline  # about 100 / 20 s
        waits = []
        for key in ("a", "b"):
            with pytest.raises(Overloaded) as caught:
                await hold(gate, release, order, key, deadline=deadline, cost=10, key=key)
            waits.append(caught.value.retry_after)
        assert waits[0] < BOOKING_HORIZON * deadline  # behind "busy" only, not behind "huge"
        assert waits[1] - waits[0] == pytest.approx(10 / gate.rate_per_capacity, rel=0.25)  # behind "a"
        release.set()
        await busy

    asyncio.run(scenario())
