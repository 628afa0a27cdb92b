"""Calibrated decisions end to end on SmolLM2: each method's arithmetic against the raw answer."""

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotread.api.systemone import parse_request, to_decision
from slotread.core.aggregate import softmax
from slotread.core.answers import Answer
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.models.load import LoadedModel
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.content_free import CONTENT_FREE_STATES
from slotread.quality.calibration.methods import TopLabelBins
from tests.core.test_decide import RecordingEngine

QUESTIONS: dict[str, Any] = {
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": "money back", "replacement": "a new card", "other": None},
    },
    "urgent": {"type": "noul", "instructions": "Is the customer in a hurry?"},
}
STATE = "My card never arrived and I need to pay rent tomorrow. Send a new one now!"


def counting(decider: Decider) -> RecordingEngine:
    engine = RecordingEngine(decider.engine)
    decider.engine = engine
    return engine


def schema(qid: str, body: dict[str, Any]) -> str:
    decision = to_decision(parse_request(body))
    return schema_hash(next(q for q in decision.questions if q.id == qid), decision.instructions)


def raw(answer: Answer | None) -> np.ndarray:
    """The uncalibrated distribution of an answer read once: the softmax of its one read's logits."""
    assert answer is not None and len(answer.reads) == 1
    return softmax(answer.reads[0].logits)


def test_contextual_divides_by_the_content_free_reads_once_per_schema(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    engine = counting(decider)
    body = {"state": STATE, "questions": QUESTIONS}
    plain = decider.decide(body)
    assert len(engine.requests) == 2
    result = decider.answer({**body, "x_calibration": "contextual"})
    assert len(engine.requests) == 2 + 2 + 2 * len(CONTENT_FREE_STATES)  # the two questions, then their blank reads
    assert result.input_tokens > plain["usage"]["input_tokens"]
    for qid in QUESTIONS:
        p_cf = decider.calibrations.content_free(schema(qid, body))[0]
        expected = raw(result.answers[qid]) / p_cf
        assert result.answers[qid].probabilities == pytest.approx(expected / expected.sum(), abs=1e-12)
    again = decider.decide({**body, "state": "Where is my refund?", "x_calibration": "contextual"})
    assert len(engine.requests) == 2 + 2 + 2 * len(CONTENT_FREE_STATES) + 2  # cached: no blank reads
    assert again["usage"] == decider.decide({**body, "state": "Where is my refund?"})["usage"]


def test_contextual_keeps_one_content_free_distribution_per_assignment(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    body = {"state": STATE, "questions": QUESTIONS, "x_permutations": 3, "x_calibration": "contextual"}
    got = decider.decide(body)["answers"]
    assert got["intent"]["x_reads"] == 3 and got["urgent"]["x_reads"] == 2
    assert sorted(decider.calibrations.content_free(schema("intent", body))) == [0, 1, 2]
    noul = decider.calibrations.content_free(schema("urgent", body))
    assert sorted(noul) == [0, 1]
    assert abs(sum(got["intent"]["probabilities"].values()) - 1) < 1e-9


def test_temperature_needs_a_fitted_artifact(smollm2: LoadedModel, tmp_path: Path) -> None:
    body = {"state": STATE, "questions": QUESTIONS, "x_calibration": "temperature"}
    with pytest.raises(InvalidRequest) as caught:
        Decider(smollm2).decide(body)
    assert [d["loc"] for d in caught.value.detail] == [["body", "x_calibration"]] * 2
    assert "no temperature is fitted for question 'intent'" in caught.value.detail[0]["msg"]
    for qid, temperature in (("intent", 2.0), ("urgent", 0.5)):
        options = tuple(QUESTIONS[qid].get("criteria", {"yes": 0, "no": 0}))
        kind = QUESTIONS[qid]["type"]
        Calibration(smollm2.name, schema(qid, body), kind, options, temperature).save(tmp_path / f"{qid}.json")
    scaled = Decider(smollm2, calibration_dir=tmp_path).answer(body).answers
    for qid, temperature in (("intent", 2.0), ("urgent", 0.5)):
        # softmax(z / T) = softmax(log p / T): p^(1/T), renormalised
        expected = raw(scaled[qid]) ** (1 / temperature)
        assert scaled[qid].probabilities == pytest.approx(expected / expected.sum(), abs=1e-12)


def test_binned_sets_the_contextual_top_to_its_bin_value(smollm2: LoadedModel, tmp_path: Path) -> None:
    body = {"state": STATE, "questions": QUESTIONS, "x_calibration": "binned"}
    with pytest.raises(InvalidRequest) as caught:
        Decider(smollm2).decide(body)
    assert [d["loc"] for d in caught.value.detail] == [["body", "x_calibration"]] * 2
    assert "no top-label bins are fitted for question 'intent'" in caught.value.detail[0]["msg"]
    one_bin = TopLabelBins(np.array([]), np.array([0.9]), np.array([50.0]))
    for qid in QUESTIONS:
        options = tuple(QUESTIONS[qid].get("criteria", {"yes": 0, "no": 0}))
        fitted = Calibration(smollm2.name, schema(qid, body), QUESTIONS[qid]["type"], options)
        replace(fitted, bins=one_bin).save(tmp_path / f"{qid}.json")
    decider = Decider(smollm2, calibration_dir=tmp_path)
    contextual = decider.answer({**body, "x_calibration": "contextual"}).answers
    binned = decider.answer(body).answers
    for qid in QUESTIONS:
        # the top becomes 0.9, the others share 0.1 in the contextual answer's proportions
        p = contextual[qid].probabilities
        top = int(p.argmax())
        expected = p * 0.1 / (1 - p[top])
        expected[top] = 0.9
        assert binned[qid].top == top and binned[qid].probabilities == pytest.approx(expected, abs=1e-12)


def test_batch_calibration_starts_neutral_and_learns_from_traffic(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    body = {"state": STATE, "questions": {"intent": QUESTIONS["intent"]}, "x_calibration": "batch"}
    first = decider.answer(body).answers["intent"]
    assert first is not None and first.probabilities == pytest.approx(raw(first), abs=1e-12)  # a uniform prior
    second = decider.answer({**body, "state": "Where is my refund?"}).answers["intent"]
    # the prior is now (1·first + 16·uniform) / 17
    expected = raw(second) / ((raw(first) + 16 / 3) / 17)
    assert second is not None and second.probabilities == pytest.approx(expected / expected.sum(), abs=1e-12)
    assert decider.decide({**body, "x_calibration": "none"})["answers"]["intent"]["x_reads"] == 1


def test_a_calibration_directory_keeps_content_free_reads_across_restarts(smollm2: LoadedModel, tmp_path: Path) -> None:
    body = {"state": STATE, "questions": {"urgent": QUESTIONS["urgent"]}, "x_calibration": "contextual"}
    first = Decider(smollm2, calibration_dir=tmp_path)
    answer = first.decide(body)["answers"]["urgent"]
    assert len(list(tmp_path.glob("*.json"))) == 1
    restarted = Decider(smollm2, calibration_dir=tmp_path)
    engine = counting(restarted)
    assert restarted.decide(body)["answers"]["urgent"] == pytest.approx(answer, abs=1e-5)  # engine tolerance
    assert len(engine.requests) == 1


def test_coverage_adds_the_prediction_set_to_choices_and_scores(smollm2: LoadedModel, tmp_path: Path) -> None:
    questions = {
        "intent": QUESTIONS["intent"],
        "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
        "urgent": QUESTIONS["urgent"],
    }
    body = {"state": STATE, "questions": questions, "x_coverage": 0.5}
    plain = Decider(smollm2)
    with pytest.raises(InvalidRequest) as caught:
        plain.decide(body)
    assert [d["loc"] for d in caught.value.detail] == [["body", "x_coverage"]] * 2  # not the noul
    assert "no conformal scores for x_calibration 'none'" in caught.value.detail[0]["msg"]
    raw = plain.decide({**body, "x_coverage": None})["answers"]
    for qid, options in (("intent", ("refund", "replacement", "other")), ("mood", ("0", "1", "2"))):
        p = np.sort(list(raw[qid]["probabilities"].values()))[::-1]
        # scores whose 2nd smallest (⌈(3 + 1)·0.5⌉ = 2) lies between 1 − p_top and 1 − p_second: only the top
        middle = 1 - (p[0] + p[1]) / 2
        scores = np.array([0.0, middle, 1.0])
        fitted = Calibration(smollm2.name, schema(qid, body), questions[qid]["type"], options)
        replace(fitted, conformal={"none": scores}).save(tmp_path / f"{qid}.json")
    decider = Decider(smollm2, calibration_dir=tmp_path)
    got = decider.decide(body)["answers"]
    assert got["intent"]["x_set"] == [raw["intent"]["choice"]]
    assert got["mood"]["x_set"] == [max(raw["mood"]["probabilities"], key=raw["mood"]["probabilities"].get)]
    assert "x_set" not in got["urgent"]
    # ⌈4 · 0.9⌉ = 4 > 3 scores: every option, in option order
    assert decider.decide({**body, "x_coverage": 0.9})["answers"]["mood"]["x_set"] == ["0", "1", "2"]
    with pytest.raises(InvalidRequest) as caught:
        decider.decide({**body, "x_permutations": 2})
    (problem,) = caught.value.detail  # a score is read the same under any x_permutations
    assert "question 'intent'" in problem["msg"] and "fitted with x_permutations 1 (1 assignments)" in problem["msg"]
    with pytest.raises(InvalidRequest, match="no conformal scores for x_calibration 'contextual'"):
        decider.decide({**body, "x_calibration": "contextual"})
