"""The admission gate: slots, a bounded queue, deadlines, disconnects and priorities (no model)."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from slotread.errors import Overloaded
from slotread.serve.admission import AdmissionGate, ClientGone


async def connected() -> bool:
    return False


async def hold(gate: AdmissionGate, release: asyncio.Event, order: list[str], name: str, **options: object) -> None:
    disconnected: Callable[[], Awaitable[bool]] = options.pop("disconnected", connected)  # type: ignore[assignment]
    deadline, priority, cost = (
        float(options.pop("deadline", 5.0)),
        int(options.pop("priority", 0)),
        options.pop("cost", 1),
    )  # type: ignore[arg-type]
    async with gate.slot(deadline, disconnected, priority, float(cost)):  # type: ignore[arg-type]
        order.append(name)
        await release.wait()


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
        waiting = [asyncio.create_task(hold(gate, release, order, f"w{i}", deadline=0.7)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 2  # expected answers in about 0.2 + 0.2 s and 0.4 + 0.2 s: queued
        started = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded, match="expected time to answer"):
            await hold(gate, release, order, "late", deadline=0.7)  # about 0.6 + 0.2 s: refused at once
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
    is expected to wait for one mean (8-question) decision and hold 0.025 s: about 0.23 s, within a
    0.4 s deadline, where a mean hold per decision would have predicted 0.2 + 0.2 s and refused it.
    Another 8-question one behind it would answer after about 0.2 + 0.025 + 0.2 s: refused."""

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
        small = asyncio.create_task(hold(gate, release, order, "small", cost=1, deadline=0.4))
        await asyncio.sleep(0.01)
        assert gate.waiting == 1  # queued, not refused
        with pytest.raises(Overloaded, match="expected time to answer"):
            await hold(gate, release, order, "big4", cost=8, deadline=0.4)
        release.set()
        await asyncio.gather(busy, small)
        assert order[-2:] == ["big3", "small"]

    asyncio.run(scenario())
