"""Decisions with example banks on SmolLM2: what the reads show, and how shortlisted answers expand."""

from typing import Any

import numpy as np
import pytest

from slotread.api.systemone import parse_request, to_decision
from slotread.core.aggregate import softmax
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.models.load import LoadedModel
from slotread.prompt.render import SolvedExample
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.content_free import CONTENT_FREE_STATES
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.shortlist import SHORTLIST_NEIGHBOURS
from tests.core.test_decide import RecordingEngine

NAMES = ("card arrival", "refund", "pin blocked", "exchange rate", "lost card")
TOPIC: dict[str, Any] = {"type": "choice", "instructions": "Which topic?", "criteria": dict.fromkeys(NAMES)}
EXAMPLES = [
    ("where is my new card", "card arrival"),
    ("my card has not arrived yet", "card arrival"),
    ("card delivery takes too long", "card arrival"),
    ("i want my money back", "refund"),
    ("please refund the payment", "refund"),
    ("my pin is blocked", "pin blocked"),
    ("what rate do you use for euros", "exchange rate"),
]
STATE = "my new card has still not arrived"


@pytest.fixture(scope="module")
def bank() -> ExampleBank:
    question = to_decision(parse_request({"state": "x", "questions": {"t": TOPIC}})).questions[0]
    return ExampleBank(question, None, [SolvedExample(s, a) for s, a in EXAMPLES], "test bank")


@pytest.fixture(scope="module")
def decider(smollm2: LoadedModel, bank: ExampleBank) -> Decider:
    return Decider(smollm2, example_banks=[bank])


def prompts(engine: RecordingEngine, decider: Decider) -> list[str]:
    return [decider.renderer.tokenizer.decode([t for s in r.prompt for t in s]) for r in engine.requests]


def recording(decider: Decider) -> RecordingEngine:
    engine = RecordingEngine(decider.engine)
    decider.engine = engine
    return engine


def test_examples_are_shown_nearest_last_and_move_the_answer(decider: Decider) -> None:
    body = {"state": STATE, "questions": {"t": TOPIC}}
    plain = decider.decide(body)
    engine = recording(decider)
    try:
        shown = decider.decide({**body, "x_examples": 3})
    finally:
        decider.engine = engine.engine
    (prompt,) = prompts(engine, decider)
    assert prompt.index("card delivery takes too long") < prompt.index("where is my new card")
    assert prompt.index("where is my new card") < prompt.index("my card has not arrived yet") < prompt.index(STATE)
    assert "Answer: A" in prompt and "my pin is blocked" not in prompt
    assert shown["usage"]["input_tokens"] > plain["usage"]["input_tokens"]
    assert shown["answers"]["t"]["probabilities"] != plain["answers"]["t"]["probabilities"]
    assert sum(shown["answers"]["t"]["probabilities"].values()) == pytest.approx(1.0)


def test_examples_follow_each_assignments_labels(decider: Decider) -> None:
    engine = recording(decider)
    try:
        decider.decide({"state": STATE, "questions": {"t": TOPIC}, "x_examples": 1, "x_permutations": 5})
    finally:
        decider.engine = engine.engine
    # the nearest example answers "card arrival", listed at position (0 - shift) mod 5 under each shift
    answers = [p.split("my card has not arrived yet\nAnswer: ")[1][0] for p in prompts(engine, decider)]
    assert answers == ["A", "E", "D", "C", "B"]


def test_a_shortlist_reads_only_its_options_and_gives_the_rest_the_residual(
    decider: Decider, bank: ExampleBank
) -> None:
    engine = recording(decider)
    try:
        answer = decider.decide({"state": STATE, "questions": {"t": TOPIC}, "x_shortlist": 2})["answers"]["t"]
    finally:
        decider.engine = engine.engine
    (prompt,) = prompts(engine, decider)
    # the two most voted labels of the nearest examples, in the question's order
    assert "A. card arrival\nB. refund\nAnswer" in prompt and "pin blocked" not in prompt and "C." not in prompt
    p = answer["probabilities"]
    assert list(p) == list(NAMES) and sum(p.values()) == pytest.approx(1.0)
    residual = bank.residual(2, SHORTLIST_NEIGHBOURS)
    assert [p[name] for name in NAMES[2:]] == pytest.approx([residual / 3] * 3)
    assert p["card arrival"] + p["refund"] == pytest.approx(1 - residual)
    assert answer["choice"] == max(p, key=p.__getitem__)


def test_contextual_reads_show_the_same_examples_and_stay_out_of_the_store(decider: Decider) -> None:
    body = {"state": STATE, "questions": {"t": TOPIC}, "x_examples": 2, "x_shortlist": 3}
    engine = recording(decider)
    try:
        raw = decider.answer(body).answers["t"]
        calibrated = decider.answer({**body, "x_calibration": "contextual"}).answers["t"]
    finally:
        decider.engine = engine.engine
    assert raw is not None and calibrated is not None
    # the content-free reads come before the calibrated read, which repeats the raw one
    first, *content_free, read = prompts(engine, decider)
    assert read == first
    assert len(content_free) == len(CONTENT_FREE_STATES)  # one draw each on a causal model
    for prompt in content_free:
        examples = read[read.index("Solved examples") : read.index(STATE)]
        assert examples in prompt and STATE not in prompt and "C. " in prompt and "D. " not in prompt
    question = raw.question
    assert decider.calibrations.content_free(schema_hash(question, None)) == {}
    assert not np.allclose(calibrated.probabilities, raw.probabilities)
    assert calibrated.probabilities.sum() == pytest.approx(1.0)
    assert np.argsort(softmax(raw.reads[0].logits))[-1] == raw.top


def test_a_question_no_bank_serves_is_refused(decider: Decider) -> None:
    other = {"type": "choice", "criteria": {"a": None, "b": None}}
    with pytest.raises(InvalidRequest) as found:
        decider.decide({"state": "s", "questions": {"t": TOPIC, "other": other}, "x_examples": 2})
    (problem,) = found.value.detail
    assert problem["loc"] == ["body", "x_examples"] and "'other'" in problem["msg"]
