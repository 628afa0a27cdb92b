"""Whole decisions on real engines: isolation, seeds, stages, draws, shapes."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from slotread.api.systemone import parse_request, to_decision
from slotread.core.assignments import shifts
from slotread.core.reads import question_text
from slotread.decider import Decider
from slotread.engines.base import Engine, ReadRequest, SlotScores
from slotread.errors import EngineFault, PromptTooLong, UnknownModel
from slotread.models.load import LoadedModel
from slotread.pipeline import read_stages
from slotread.prompt.render import Renderer


class RecordingEngine:
    """A real engine that also keeps every request it was asked to read."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.family = engine.family
        self.noisy = engine.noisy
        self.deterministic = engine.deterministic
        self.max_tokens = engine.max_tokens
        self.requests: list[ReadRequest] = []

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.requests += requests
        return self.engine.read(requests)


@pytest.fixture(scope="module", params=["smollm2", "tiny_diffusion", "tiny_bert", "tiny_dream"])
def decider(request: pytest.FixtureRequest) -> Decider:
    loaded: LoadedModel = request.getfixturevalue(request.param)
    return Decider(loaded)


QUESTIONS: dict[str, Any] = {
    "urgent": {
        "type": "noul",
        "instructions": "Is the customer in a hurry?",
        "criteria": {"true": "they need it today"},
    },
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": "money back", "replacement": {"what": "a new card"}, "Other ": None},
    },
    "mood": {
        "type": "score",
        "instructions": "How upset are they?",
        "criteria": ["calm", "annoyed", "furious"],
    },
}
STATE = "My card never arrived and I need to pay rent tomorrow. Send a new one now!"


def answers(decider: Decider, questions: dict[str, Any], **extra: Any) -> dict[str, Any]:
    response = decider.decide({"state": STATE, "questions": questions, **extra})
    return response["answers"]


def assert_finite(value: Any) -> None:
    if isinstance(value, dict):
        for item in value.values():
            assert_finite(item)
    elif isinstance(value, float):
        assert math.isfinite(value)


def test_answer_shapes(decider: Decider) -> None:
    response = decider.decide({"state": STATE, "questions": QUESTIONS})
    assert response["model"] == decider.name
    assert set(response["usage"]) == {"input_tokens", "output_tokens"}
    assert all(type(v) is int and v > 0 for v in response["usage"].values())
    got = response["answers"]
    assert list(got) == list(QUESTIONS)
    assert got["urgent"]["type"] == "noul" and type(got["urgent"]["noul"]) is float
    assert "confidence" not in got["urgent"] and 0 <= got["urgent"]["noul"] <= 1
    intent = got["intent"]
    assert list(intent["probabilities"]) == ["refund", "replacement", "Other "]
    assert intent["choice"] == max(intent["probabilities"], key=intent["probabilities"].get)
    mood = got["mood"]
    assert mood["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    p = np.array(list(mood["probabilities"].values()))
    assert mood["score"] == pytest.approx(float(np.dot(np.arange(3), p)))
    for answer in (intent, mood):
        assert abs(sum(answer["probabilities"].values()) - 1) < 1e-6
        assert 0 <= answer["confidence"] <= 1
    assert_finite(got)


def assert_close(got: Any, expected: Any, tolerance: float = 1e-5) -> None:
    """Equal answers up to the engines' batch-composition tolerance (1e-5 in float32)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected)
        for key in expected:
            assert_close(got[key], expected[key], tolerance)
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, abs=tolerance)
    else:
        assert got == expected


def test_renaming_reordering_and_adding_questions_moves_no_answer(decider: Decider) -> None:
    base = answers(decider, QUESTIONS)
    renamed = {f"renamed {qid} 🙂": q for qid, q in reversed(QUESTIONS.items())}
    renamed["extra.question"] = {"type": "noul", "instructions": "Is it about a loan?"}
    moved = answers(decider, renamed)
    for qid in QUESTIONS:
        assert_close(moved[f"renamed {qid} 🙂"], base[qid])


def recorded(decider: Decider, body: dict[str, Any]) -> list[ReadRequest]:
    """The engine requests one decision makes."""
    recorder = RecordingEngine(decider.engine)
    read_stages(to_decision(parse_request(body)), recorder, decider.renderer)
    return recorder.requests


def test_question_ids_never_reach_the_model(decider: Decider) -> None:
    requests = recorded(decider, {"state": STATE, "questions": {"SECRETIDENTIFIER": {"type": "noul"}}})
    tokenizer = decider.renderer.tokenizer
    for request in requests:
        assert "SECRETIDENTIFIER" not in tokenizer.decode([*request.prompt_ids, *request.canvas])


def test_same_seed_same_answer(decider: Decider) -> None:
    first = answers(decider, QUESTIONS, x_seed=11)
    assert answers(decider, QUESTIONS, x_seed=11) == first
    if decider.engine.noisy:
        assert answers(decider, QUESTIONS, x_seed=12)["intent"] != first["intent"]


def test_255_options_and_10_levels(decider: Decider) -> None:
    questions = {
        "wide": {"type": "choice", "criteria": {f"option {i}": None for i in range(255)}},
        "fine": {"type": "score", "criteria": [f"level {i}" for i in range(10)]},
    }
    got = answers(decider, questions)
    assert len(got["wide"]["probabilities"]) == 255
    assert list(got["fine"]["probabilities"]) == [str(i) for i in range(10)]
    for answer in got.values():
        assert abs(sum(answer["probabilities"].values()) - 1) < 1e-6
    assert 0 <= got["fine"]["score"] <= 9
    assert_finite(got)


def test_an_unasked_question_has_no_answer_and_dependants_see_earlier_answers(decider: Decider) -> None:
    first = answers(decider, {"urgent": QUESTIONS["urgent"]})["urgent"]["noul"]
    top = "yes" if first >= 0.5 else "no"
    other = "no" if top == "yes" else "yes"
    questions = {
        "urgent": QUESTIONS["urgent"],
        "asked": {"type": "noul", "ask_if": {"urgent": [top]}, "instructions": "Escalate?"},
        "skipped": {"type": "noul", "ask_if": {"urgent": [other]}},
        "after_skip": {"type": "noul", "ask_if": {"skipped": [True, False]}},
    }
    got = answers(decider, questions)
    assert list(got) == ["urgent", "asked"]
    assert got["asked"]["type"] == "noul"
    with_context = {
        "urgent": QUESTIONS["urgent"],
        "q": {"type": "noul", "depends_on": "urgent", "instructions": "x?"},
    }
    last = recorded(decider, {"state": STATE, "questions": with_context})[-1]
    text = decider.renderer.tokenizer.decode(last.prompt_ids)
    assert f"- Is the customer in a hurry? {top.capitalize()}" in text


def test_prompt_too_long_is_refused_before_reading(decider: Decider) -> None:
    recorder = RecordingEngine(decider.engine)
    decision = to_decision(parse_request({"state": STATE * 20, "questions": {"q": {"type": "noul"}}}))
    with pytest.raises(PromptTooLong):
        read_stages(decision, recorder, decider.renderer, max_tokens=64)
    assert recorder.requests == []


def test_unknown_model_is_refused_and_aliases_accepted(decider: Decider) -> None:
    with pytest.raises(UnknownModel):
        decider.decide({"model": "gpt-9", "state": "s", "questions": {"q": {"type": "noul"}}})
    for name in ("jev-latest", decider.name):
        assert decider.decide({"model": name, "state": "s", "questions": {"q": {"type": "noul"}}})["answers"]["q"]


def test_draws_report_spread_only_when_there_are_several(decider: Decider) -> None:
    got = answers(decider, QUESTIONS, x_samples=3)
    for answer in got.values():
        if decider.engine.noisy:
            assert answer["x_reads"] == 3 and "x_stderr" in answer and 0 <= answer["x_agreement"] <= 1
        else:
            assert answer["x_reads"] == 1 and "x_stderr" not in answer
    assert set(got["intent"].get("x_stderr", {})) <= set(got["intent"]["probabilities"])


def test_auto_samples_reread_only_uncertain_questions(decider: Decider) -> None:
    got = answers(decider, QUESTIONS, x_samples="auto")
    for answer in got.values():
        if answer["x_reads"] == 1:
            assert not decider.engine.noisy or answer["x_entropy"] <= 0.5
        else:
            assert decider.engine.noisy and answer["x_reads"] == 4


@pytest.mark.parametrize(
    ("options", "canvases", "reads"),
    [({"x_samples": 2}, 2, [2, 2, 2]), ({"x_permutations": 3}, 3, [2, 3, 1])],
)
def test_joint_canvas_reads_a_stage_once_per_draw_and_assignment(
    tiny_diffusion: LoadedModel, options: dict[str, int], canvases: int, reads: list[int]
) -> None:
    # with x_permutations 3: the noul has 2 assignments, the choice 3, the score 1
    decider = Decider(tiny_diffusion)
    body = {"state": STATE, "questions": QUESTIONS, "x_joint": True, **options}
    requests = recorded(decider, body)
    assert len(requests) == canvases and all(len(r.slots) == 3 for r in requests)
    got = decider.decide(body)["answers"]
    assert list(got) == list(QUESTIONS) and [got[q]["x_reads"] for q in QUESTIONS] == reads
    assert got != answers(decider, QUESTIONS, **options)


def test_permutations_read_each_assignment_once(decider: Decider) -> None:
    body = {"state": STATE, "questions": QUESTIONS, "x_permutations": 3}
    assert len(recorded(decider, body)) == 2 + 3 + 1  # noul: as given and swapped; choice: 3 shifts; score: 1
    got = decider.decide(body)["answers"]
    assert [got[q]["x_reads"] for q in QUESTIONS] == [2, 3, 1]
    for qid in ("urgent", "intent"):
        assert 0 <= got[qid]["x_agreement"] <= 1 and "x_stderr" in got[qid]
    assert "x_stderr" not in got["mood"] or decider.engine.noisy
    for answer in (got["intent"], got["mood"]):
        assert abs(sum(answer["probabilities"].values()) - 1) < 1e-9
    assert answers(decider, QUESTIONS, x_permutations=1) == answers(decider, QUESTIONS)
    assert_finite(got)


def test_permutations_multiply_the_draws(decider: Decider) -> None:
    got = answers(decider, {"intent": QUESTIONS["intent"]}, x_permutations=3, x_samples=2)
    assert got["intent"]["x_reads"] == (6 if decider.engine.noisy else 3)


class OptionPickingEngine:
    """A causal engine that reads the prompt as text and puts all its weight on the label listed for one
    option (or, for a yes/no question, on the word that means yes, swapped or not)."""

    family = "causal"
    noisy = False
    deterministic = False
    max_tokens = 100_000

    def __init__(self, renderer: Renderer, option: str) -> None:
        self.tokenizer = renderer.tokenizer
        self.option = option
        self.requests: list[ReadRequest] = []

    def _label(self, prompt: str) -> str:
        if "Answer Yes or No." in prompt:
            return "Yes"
        if "answer No if the answer is yes" in prompt:
            return "No"
        found = re.search(rf"^(\w+)\. {re.escape(self.option)}$", prompt, re.MULTILINE)
        assert found, prompt
        return found.group(1)

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.requests += requests
        results = []
        for request in requests:
            (slot,) = request.slots
            favoured = self.tokenizer.encode(self._label(self.tokenizer.decode(request.prompt_ids)))[-1]
            logits = np.array([20.0 if i == favoured else 0.0 for i in slot.label_ids], dtype=np.float32)
            results.append(SlotScores((logits,), (1.0,), (True,), (favoured,), (20.0,), (20.0,)))
        return results


@pytest.mark.parametrize("k", [1, 2, 5])
def test_every_assignment_maps_back_to_the_option_it_listed(smollm2: LoadedModel, k: int) -> None:
    renderer = Renderer(smollm2.tokenizer, "causal")
    names = ["refund", "replacement", "lost", "stolen", "other"]
    questions = {
        "intent": {"type": "choice", "criteria": dict.fromkeys(names)},
        "urgent": {"type": "noul"},
    }
    engine = OptionPickingEngine(renderer, "lost")
    decision = to_decision(parse_request({"state": STATE, "questions": questions, "x_permutations": k}))
    result = read_stages(decision, engine, renderer)
    intent, urgent = result.answers["intent"], result.answers["urgent"]
    assert intent is not None and urgent is not None
    assert intent.top_name == "lost" and intent.probabilities[2] > 0.999
    assert [read.shift for read in intent.reads] == list(shifts(5, k))
    assert urgent.top_name == "yes" and urgent.summary.reads == min(k, 2)
    # the label that read "lost" moved with each shift
    found = [
        re.search(r"^(\w+)\. lost$", smollm2.tokenizer.decode(r.prompt_ids), re.MULTILINE) for r in engine.requests
    ]
    assert len({m.group(1) for m in found if m}) == len(intent.reads)


def test_a_question_marked_alone_keeps_its_own_canvas(tiny_diffusion: LoadedModel) -> None:
    decider = Decider(tiny_diffusion)
    questions = {**QUESTIONS, "intent": {**QUESTIONS["intent"], "alone": True}}
    requests = recorded(decider, {"state": STATE, "questions": questions, "joint": True})
    assert sorted(len(r.slots) for r in requests) == [1, 2]
    alone = decider.decide({"state": STATE, "questions": questions, "joint": True})["answers"]["intent"]
    single = answers(decider, {"intent": QUESTIONS["intent"]})["intent"]
    assert alone["probabilities"] == pytest.approx(single["probabilities"], abs=1e-4)  # batch rounding only


@pytest.mark.parametrize("prompt", ["own", "shared"])
def test_chunk_rows_split_a_joint_stage_into_narrow_canvases(tiny_diffusion: LoadedModel, prompt: str) -> None:
    decider = Decider(tiny_diffusion)
    questions = {f"q{n}": {"type": "noul", "instructions": f"Is point {n} true?"} for n in range(6)}
    body = {"state": STATE, "questions": questions, "joint": True, "chunk_prompt": prompt}
    assert [len(r.slots) for r in recorded(decider, body)] == [6]
    texts = tuple(question_text(q, decider.renderer) for q in to_decision(parse_request(body)).questions)
    rows = decider.renderer.joint_rows(texts[:2], None if prompt == "own" else (0, 1))
    requests = recorded(decider, {**body, "chunk_rows": rows})
    assert [len(r.slots) for r in requests] == [2, 2, 2]
    schemas = {r.prompt[:-1] for r in requests}
    assert len(schemas) == (3 if prompt == "own" else 1)  # a shared prompt lists all six questions in each chunk
    got = decider.decide({**body, "chunk_rows": rows})["answers"]
    assert list(got) == list(questions) and all(0 <= a["noul"] <= 1 for a in got.values())


def test_auto_threshold_and_auto_max_set_the_rereads(tiny_diffusion: LoadedModel) -> None:
    decider = Decider(tiny_diffusion)
    never = answers(decider, QUESTIONS, samples="auto", auto_threshold=1.0, auto_max=8)
    always = answers(decider, QUESTIONS, samples="auto", auto_threshold=0.0, auto_max=6)
    assert [a["x_reads"] for a in never.values()] == [1, 1, 1]
    assert [a["x_reads"] for a in always.values()] == [6, 6, 6]
    six = answers(decider, QUESTIONS, samples=6)
    assert [a["noul"] for a in (always["urgent"], six["urgent"])] == pytest.approx([six["urgent"]["noul"]] * 2)


def test_ask_reads_the_named_questions_and_what_they_need(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    questions = {
        **QUESTIONS,
        "why": {"type": "choice", "criteria": {"card": None, "rent": None}, "depends_on": "urgent"},
    }
    requests = recorded(decider, {"state": STATE, "questions": questions, "ask": ["why"]})
    assert len(requests) == 2  # urgent, then why
    got = decider.decide({"state": STATE, "questions": questions, "ask": ["why"]})["answers"]
    assert list(got) == ["urgent", "why"]  # the questions not asked have no answer (never null)
    full = answers(decider, questions)
    assert got["urgent"]["noul"] == pytest.approx(full["urgent"]["noul"], abs=1e-4)  # batch rounding only
    assert got["why"]["probabilities"] == pytest.approx(full["why"]["probabilities"], abs=1e-4)


class NanEngine:
    """A real engine whose first slot of every read comes back NaN, as a faulty kernel would return it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.family = engine.family
        self.noisy = engine.noisy
        self.deterministic = engine.deterministic
        self.max_tokens = engine.max_tokens

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        scores = self.engine.read(requests)
        return [replace(s, logits=(np.full_like(s.logits[0], np.nan), *s.logits[1:])) for s in scores]


def test_non_finite_logits_stop_the_decision_naming_the_question(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    decider.engine = NanEngine(decider.engine)
    with pytest.raises(EngineFault, match="non-finite label logits for question 'urgent'"):
        decider.decide({"state": STATE, "questions": {"urgent": QUESTIONS["urgent"]}})
