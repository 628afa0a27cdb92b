"""The batcher: concurrent decisions' reads merge into one engine call, and nothing else changes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from slotread.core.questions import Option, Question
from slotread.core.reads import question_text
from slotread.decider import Decider
from slotread.engines.base import Engine, ReadRequest, SlotScores
from slotread.engines.thought import ThoughtRequest
from slotread.errors import ReadAbandoned
from slotread.models.load import LoadedModel
from slotread.serve.batcher import BatchingEngine
from tests.serve.live import HeldEngine, ThreadsSeen

STATES = ["the server is down", "thanks, all good", "my card was stolen", "how do I reset my PIN?", "refund me now"]


def reads(decider: Decider) -> list[ReadRequest]:
    """One real read per state: a yes/no question rendered by the model's own renderer."""
    question = Question("q", "noul", "Is this urgent?", (Option("yes"), Option("no")))
    text = question_text(question, decider.renderer)
    return [decider.renderer.render_branch(text, state, None, ()).with_seed(0) for state in STATES]


def wait_until(condition: object, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_reads_queued_while_the_engine_is_busy_go_in_one_batch_with_the_same_results(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    requests = reads(decider)
    alone = [decider.engine.read([r])[0] for r in requests]
    held = HeldEngine(decider.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads))
    calls = [[requests[0]], [requests[1]], [requests[2], requests[3]], [requests[4]]]
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(batcher.read, calls[0])
        assert held.entered.wait(30)
        rest = [pool.submit(batcher.read, call) for call in calls[1:]]
        wait_until(lambda: batcher.pending == 4)
        held.release.set()
        results = [first.result(30), *(future.result(30) for future in rest)]
    assert sizes == [1, 4]  # the three waiting calls were read together
    merged = [scores for result in results for scores in result]
    for got, expected in zip(merged, alone, strict=True):
        np.testing.assert_allclose(got.logits[0], expected.logits[0], atol=1e-4, rtol=1e-5)


def test_a_call_waits_for_the_callers_back_from_the_last_one(smollm2: LoadedModel) -> None:
    """Four callers that each ask again once answered: the first is read alone while the other three
    queue. The three then wait for the first to ask again (four were waiting or running at once), and
    all four reads go in one call; without the wait they would take turns, one then three, for good."""
    decider = Decider(smollm2)
    requests = reads(decider)
    held = HeldEngine(decider.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads), max_wait_s=2.0)

    def twice(request: ReadRequest) -> None:
        batcher.read([request])
        batcher.read([request])

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(twice, requests[0])
        assert held.entered.wait(30)
        rest = [pool.submit(twice, request) for request in requests[1:4]]
        wait_until(lambda: batcher.pending == 3)
        held.release.set()
        for future in [first, *rest]:
            future.result(60)
    # the last three second reads wait the 2 s for a fourth caller that is done, then go
    assert sizes == [1, 4, 3]


def test_a_call_takes_half_of_the_callers_while_the_others_are_on_their_way_back(smollm2: LoadedModel) -> None:
    """Eight callers that each ask again once answered, the first read alone while seven queue, and no
    wait: the first caller takes a second to come back, and the next call reads four of the seven
    (half of the eight active at once); the other three go with the callers back from it. Taking all
    seven, the two groups would take turns at one and seven for good (W1 on an H200 settled at 12 and
    20 of 32)."""
    decider = Decider(smollm2)
    requests = [*reads(decider), *reads(decider)][:8]
    held = HeldEngine(decider.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads), max_wait_s=0.0)

    def twice(request: ReadRequest, back_after: float = 0.0) -> None:
        batcher.read([request])
        time.sleep(back_after)
        batcher.read([request])

    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(twice, requests[0], 1.0)
        assert held.entered.wait(30)
        rest = [pool.submit(twice, request) for request in requests[1:]]
        wait_until(lambda: batcher.pending == 7)
        held.release.set()
        for future in [first, *rest]:
            future.result(60)
    assert sizes[:2] == [1, 4] and sum(sizes) == 16


def test_callers_that_do_not_come_back_stop_the_waits(smollm2: LoadedModel) -> None:
    """Independent requests (each caller reads once): a call waits for a fourth caller that never
    comes (3 s), after which the next such calls start at once."""
    decider = Decider(smollm2)
    requests = reads(decider)
    held = HeldEngine(decider.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads), max_wait_s=3.0)

    def burst(pool: ThreadPoolExecutor, batch: list[ReadRequest]) -> float:
        """One read held while three more queue: the seconds from the release until all four are read."""
        held.entered.clear()
        held.release.clear()
        first = pool.submit(batcher.read, batch[:1])
        assert held.entered.wait(30)
        rest = [pool.submit(batcher.read, [request]) for request in batch[1:]]
        wait_until(lambda: batcher.pending == 3)
        released = time.monotonic()
        held.release.set()
        for future in [first, *rest]:
            future.result(60)
        return time.monotonic() - released

    with ThreadPoolExecutor(4) as pool:
        assert burst(pool, requests[:4]) >= 3.0  # waited for the first caller, who was done
        assert burst(pool, requests[1:5]) < 3.0
    assert sizes == [1, 3, 1, 3]


def test_a_lone_caller_never_waits(smollm2: LoadedModel) -> None:
    sizes: list[int] = []
    batcher = BatchingEngine(
        Decider(smollm2).engine, observe=lambda reads, seconds: sizes.append(reads), max_wait_s=60.0
    )
    requests = reads(Decider(smollm2))
    started = time.monotonic()
    for request in requests[:3]:
        batcher.read([request])
    assert sizes == [1, 1, 1] and time.monotonic() - started < 30


class FailsOnSecond:
    """An engine whose read fails whenever the second request is in the batch."""

    family = "causal"
    noisy = False
    deterministic = False
    max_tokens = 100

    def __init__(self, marker: ReadRequest) -> None:
        self.marker = marker
        self.batches: list[int] = []
        self.busy = threading.Event()
        self.go = threading.Event()

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.batches.append(len(requests))
        if len(self.batches) == 1:
            self.busy.set()
            assert self.go.wait(30)
        if self.marker in requests:
            raise ValueError("this read is bad")
        return [SlotScores((np.zeros(2, np.float32),), (1.0,), (True,), (0,), (0.0,), (np.log(2.0),)) for _ in requests]


def test_every_engine_call_runs_in_one_thread_whoever_leads_it(smollm2: LoadedModel) -> None:
    """On the CPU torch computes slower once several threads have used it, so the callers, who lead
    calls in turn, hand every read and thought to the batcher's one engine thread."""
    decider = Decider(smollm2)
    requests = reads(decider)
    engine = ThreadsSeen(decider.engine)
    batcher = BatchingEngine(engine)
    callers: set[int] = set()

    def decide(request: ReadRequest) -> None:
        callers.add(threading.get_ident())
        for _ in range(3):
            batcher.read([request])
        batcher.think([ThoughtRequest(request.prompt, 4, frozenset())])

    with ThreadPoolExecutor(len(requests)) as pool:
        for future in [pool.submit(decide, request) for request in requests]:
            future.result(60)
    assert len(engine.threads) >= 4 and len(set(engine.threads)) == 1
    assert engine.threads[0] not in callers and len(callers) > 1


def test_a_failing_read_fails_only_its_own_caller(smollm2: LoadedModel) -> None:
    requests = reads(Decider(smollm2))
    engine = FailsOnSecond(requests[1])
    batcher = BatchingEngine(engine)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(batcher.read, [requests[0]])
        assert engine.busy.wait(30)
        bad = pool.submit(batcher.read, [requests[1]])
        good = pool.submit(batcher.read, [requests[2]])
        wait_until(lambda: batcher.pending == 2)
        engine.go.set()
        assert len(first.result(30)) == 1 and len(good.result(30)) == 1
        with pytest.raises(ValueError, match="bad"):
            bad.result(30)
    assert engine.batches == [1, 2, 1, 1]  # the merged batch failed, then each was read alone


def test_reads_nobody_waits_for_any_more_are_dropped_when_their_call_would_start(smollm2: LoadedModel) -> None:
    requests = reads(Decider(smollm2))
    held = HeldEngine(Decider(smollm2).engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads))
    left = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(batcher.read, [requests[0]], abandoned=left.is_set)  # already running: read
        assert held.entered.wait(30)
        gone = pool.submit(batcher.read, [requests[1], requests[2]], abandoned=left.is_set)
        kept = pool.submit(batcher.read, [requests[3]], abandoned=lambda: False)
        wait_until(lambda: batcher.pending == 3)
        left.set()
        held.release.set()
        assert len(first.result(30)) == 1 and len(kept.result(30)) == 1
        with pytest.raises(ReadAbandoned):
            gone.result(30)
    assert sizes == [1, 1]  # the abandoned caller's two reads never reached the engine


def test_thoughts_wait_for_the_engine_and_reads_wait_for_thoughts(smollm2: LoadedModel) -> None:
    """A decision's thought runs with the engine to itself: after a read in progress, before reads queued later."""
    decider = Decider(smollm2)
    held = HeldEngine(decider.engine)
    batcher = BatchingEngine(held)
    assert batcher.thinks
    prompt = decider.renderer.render_branch(
        question_text(Question("q", "noul", "Is this urgent?", (Option("yes"), Option("no"))), decider.renderer),
        STATES[0],
    ).prompt
    asked = [ThoughtRequest(prompt, 6, frozenset())]
    expected = decider.engine.think(asked)
    with ThreadPoolExecutor(2) as pool:
        reading = pool.submit(batcher.read, reads(decider)[:1])
        assert held.entered.wait(30)
        thinking = pool.submit(batcher.think, asked)
        time.sleep(0.2)
        assert not thinking.done()  # the engine is busy reading
        held.release.set()
        assert thinking.result(60) == expected
        reading.result(30)


class CountedThoughts(HeldEngine):
    """A held engine that records how many thoughts each ``think`` call generated."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.thought_batches: list[int] = []

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        self.thought_batches.append(len(requests))
        return super().think(requests)


@pytest.mark.parametrize("deterministic", [False, True])
def test_thoughts_queued_while_the_engine_is_busy_are_generated_in_one_call(
    smollm2: LoadedModel, deterministic: bool
) -> None:
    """Concurrent decisions' thoughts merge into one think call (one per decision when deterministic), and
    each caller gets what the engine writes for that merged call."""
    decider = Decider(smollm2)
    counted = CountedThoughts(decider.engine)
    counted.deterministic = deterministic
    batcher = BatchingEngine(counted)
    asked = [
        [ThoughtRequest(request.prompt, 5, frozenset())] for request in reads(decider)[:3]
    ]  # three decisions, one thought each
    expected = decider.engine.think([call[0] for call in asked])
    with ThreadPoolExecutor(4) as pool:
        reading = pool.submit(batcher.read, reads(decider)[3:4])
        assert counted.entered.wait(30)
        thinking = [pool.submit(batcher.think, call) for call in asked]
        wait_until(lambda: batcher.pending == 3)
        counted.release.set()
        got = [future.result(60)[0] for future in thinking]
        reading.result(30)
    assert counted.thought_batches == ([1, 1, 1] if deterministic else [3])
    if not deterministic:
        assert got == expected
    else:
        assert got == [decider.engine.think(call)[0] for call in asked]
