"""The runner: run folders that resume, and SmolLM2 answering through the public Decider API."""

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest

from slotread.core.aggregate import softmax
from slotread.decider import Decider
from slotread.errors import EvalError, InvalidRequest
from slotread.eval.datasets import Dataset, Item, Task, load_dataset
from slotread.eval.predictions import Prediction
from slotread.eval.runner import (
    DeciderPredictor,
    build_request,
    evaluate_model,
    read_answer,
    run,
    run_info,
    shuffle_options,
)
from slotread.models.load import LoadedModel
from slotread.quality.calibration.train import calibrate
from slotread.serve.batcher import BatchingEngine

TASK = Task(
    "choice",
    {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None, "c": None}},
    ("A", "B", "C"),
)
DATASET = Dataset("toy", "test", TASK, tuple(Item(str(i), f"state {i}", i % 3) for i in range(6)))


class Scripted:
    """A predictor from a fixed table (the runner's Predictor is any callable from Item to Prediction);
    it records what it was asked and can stop the run at a given item, as Ctrl-C would."""

    def __init__(self, stop_at: str | None = None) -> None:
        self.asked: list[str] = []
        self.stop_at = stop_at

    def __call__(self, item: Item) -> Prediction:
        if item.id == self.stop_at:
            raise KeyboardInterrupt
        self.asked.append(item.id)
        p = np.full(3, 0.1)
        p[0 if item.id in ("0", "1") else item.gold] = 0.8  # item 1 is wrong, the rest right
        return Prediction(p, reads=1)


def test_a_run_writes_its_folder(tmp_path: Path) -> None:
    predictor = Scripted()
    metrics = run(
        DATASET, tmp_path / "run", run_info(DATASET, "scripted", {"x_seed": 0}), lambda: predictor, progress=False
    )
    assert predictor.asked == ["0", "1", "2", "3", "4", "5"]
    assert metrics["items"] == 6 and metrics["accuracy"] == pytest.approx(5 / 6) and metrics["reads_per_item"] == 1.0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == metrics
    assert (tmp_path / "run" / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["system"] == "scripted" and info["task"]["classes"] == ["A", "B", "C"]


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    info = run_info(DATASET, "scripted", {"x_seed": 0})
    first = Scripted(stop_at="3")
    with pytest.raises(KeyboardInterrupt):
        run(DATASET, out, info, lambda: first, progress=False)
    assert first.asked == ["0", "1", "2"] and not (out / "metrics.json").exists()
    second = Scripted()
    metrics = run(DATASET, out, info, lambda: second, progress=False)
    assert second.asked == ["3", "4", "5"]
    assert metrics["items"] == 6 and metrics["accuracy"] == pytest.approx(5 / 6)
    # a finished run builds no predictor at all
    assert run(DATASET, out, info, lambda: pytest.fail("loaded a model for a finished run"), progress=False) == metrics


def test_a_folder_holding_another_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(DATASET, out, run_info(DATASET, "scripted", {"x_seed": 0}), Scripted, progress=False)
    with pytest.raises(EvalError, match="differs in request, system"):
        run(DATASET, out, run_info(DATASET, "other", {"x_seed": 1}), Scripted, progress=False)
    fewer = Dataset("toy", "test", TASK, DATASET.items[:3])
    with pytest.raises(EvalError, match="rows for items not in this run"):
        run(fewer, out, run_info(fewer, "scripted", {"x_seed": 0}), Scripted, progress=False)


def test_requests_carry_the_task_question_and_the_extra_fields() -> None:
    task = Task("noul", {"type": "noul", "instructions": "Is it?"}, ("yes", "no"))
    request = build_request(task, Item("7", "a passage", 0), {"x_seed": 3, "x_coverage": 0.9})
    assert request == {
        "x_seed": 3,
        "x_coverage": 0.9,
        "state": "a passage",
        "questions": {"answer": {"type": "noul", "instructions": "Is it?"}},
    }
    request["questions"]["answer"]["instructions"] = "changed"
    assert task.question == {"type": "noul", "instructions": "Is it?"}


def test_shuffle_options_reorders_a_choice_and_refuses_scores_and_nouls() -> None:
    criteria = {name: f"about {name}" for name in "abcdefgh"}
    task = Task("choice", {"type": "choice", "instructions": "Which?", "criteria": criteria}, tuple("ABCDEFGH"))
    shuffled = shuffle_options(task, 3)
    names = list("abcdefgh")
    random.Random(3).shuffle(names)
    assert list(shuffled["criteria"]) == names != list("abcdefgh")
    assert shuffled["criteria"] == criteria and shuffled["instructions"] == "Which?"  # same options, same text
    assert shuffle_options(task, 3) == shuffled and list(task.question["criteria"]) == list("abcdefgh")
    request = build_request(task, Item("1", "s", 0), {"x_seed": 0}, shuffled)
    assert list(request["questions"]["answer"]["criteria"]) == names
    score = Task("score", {"type": "score", "criteria": ["lo", "hi"]}, ("0", "1"))
    with pytest.raises(EvalError, match="this task is a score"):
        shuffle_options(score, 3)
    with pytest.raises(EvalError, match="this task is a noul"):
        shuffle_options(Task("noul", {"type": "noul"}, ("yes", "no")), 3)


def test_read_answer_orders_probabilities_by_class() -> None:
    score = Task("score", {"type": "score", "criteria": ["lo", "hi"]}, ("0", "1"))
    response = {
        "answers": {
            "answer": {
                "type": "score",
                "probabilities": {"1": 0.75, "0": 0.25},
                "x_reads": 4,
                "x_stderr": {"0": 0.1, "1": 0.2},
            }
        },
        "usage": {"input_tokens": 30, "output_tokens": 4},
    }
    prediction = read_answer(score, response)
    assert prediction.probabilities.tolist() == [0.25, 0.75]
    assert (prediction.reads, prediction.input_tokens, prediction.stderr) == (4, 30, 0.2)
    noul = read_answer(
        Task("noul", {"type": "noul"}, ("yes", "no")),
        {"answers": {"answer": {"noul": 0.25}}, "usage": {"input_tokens": 1}},
    )
    assert noul.probabilities.tolist() == [0.25, 0.75]
    assert prediction.prediction_set is None and noul.prediction_set is None


def test_read_answer_keeps_the_prediction_set_as_class_indices() -> None:
    response = {
        "answers": {"answer": {"probabilities": {"c": 0.1, "a": 0.5, "b": 0.4}, "x_set": ["b", "a"]}},
        "usage": {"input_tokens": 3},
    }
    prediction = read_answer(TASK, response)
    assert prediction.probabilities.tolist() == [0.5, 0.4, 0.1] and prediction.prediction_set == (0, 1)


@pytest.fixture(scope="module")
def decider(smollm2: LoadedModel) -> Decider:
    return Decider(smollm2)


@pytest.fixture
def urgent(tmp_path: Path) -> Dataset:
    (tmp_path / "q.json").write_text(json.dumps({"type": "noul", "instructions": "Is this urgent?"}))
    rows = [
        ("fire in the server room", "yes"),
        ("lunch menu for friday", "no"),
        ("the site is down", "yes"),
        ("thanks!", "no"),
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in rows))
    return load_dataset(str(tmp_path / "d.jsonl"), question=tmp_path / "q.json")


def test_smollm2_answers_through_the_public_api(decider: Decider, urgent: Dataset, tmp_path: Path) -> None:
    out = tmp_path / "run"
    fields = {"x_calibration": "none"}  # passed through as a client would send it
    metrics = evaluate_model(urgent, out, decider, seed=5, request_fields=fields, progress=False)
    info = json.loads((out / "run.json").read_text())
    assert info["system"] == "smollm2-135m-instruct" and info["request"] == {"x_seed": 5, "x_calibration": "none"}
    rows = list(csv.DictReader((out / "predictions.csv").read_text().splitlines()))
    assert [row["id"] for row in rows] == ["0", "1", "2", "3"]
    # each row holds exactly what the Decider answers to the same request
    direct = decider.decide(build_request(urgent.task, urgent.items[2], {"x_seed": 5}))["answers"]["answer"]
    assert float(rows[2]["p:yes"]) == direct["noul"] and float(rows[2]["label_mass"]) == direct["x_label_mass"]
    for row in rows:
        assert float(row["p:yes"]) + float(row["p:no"]) == pytest.approx(1.0)
        assert row["reads"] == "1" and int(row["input_tokens"]) > 0
    assert metrics["items"] == 4 and metrics["reads_per_item"] == 1.0
    assert metrics["accuracy"] == pytest.approx(np.mean([row["correct"] == "1" for row in rows]))


def test_a_bad_request_field_is_refused_before_anything_runs(urgent: Dataset, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="x_samples"):
        evaluate_model(urgent, tmp_path / "run", "no-such-model", request_fields={"x_samples": 0})
    with pytest.raises(EvalError, match="may not replace"):
        evaluate_model(urgent, tmp_path / "run", "no-such-model", request_fields={"state": "x"})
    assert not (tmp_path / "run").exists()


def test_a_calibration_directory_is_served_and_recorded(
    smollm2: LoadedModel, cache_dir: Path, urgent: Dataset, tmp_path: Path
) -> None:
    artifacts = tmp_path / "calibration"
    fit = calibrate(Decider(smollm2), urgent)
    fit.calibration.save(artifacts / "urgent.json")
    out = tmp_path / "run"
    fields = {"x_calibration": "temperature"}
    evaluate_model(
        urgent,
        out,
        smollm2.name,
        request_fields=fields,
        cache_dir=cache_dir,
        dtype="float32",  # as the smollm2 fixture loads it
        calibration_dir=artifacts,
        progress=False,
    )
    assert json.loads((out / "run.json").read_text())["calibration_dir"] == str(artifacts)
    rows = list(csv.DictReader((out / "predictions.csv").read_text().splitlines()))
    temperature = fit.calibration.temperature
    assert temperature is not None
    p = softmax(fit.logits[0, 0] / temperature)  # the first item's one read, scaled
    assert float(rows[0]["p:yes"]) == pytest.approx(p[0], abs=1e-5)


def test_a_shuffled_run_asks_the_reordered_options_and_keeps_class_order(decider: Decider, tmp_path: Path) -> None:
    criteria = {"card arrival": None, "request refund": None, "lost or stolen card": None, "exchange rate": None}
    task = Task("choice", {"type": "choice", "instructions": "Which topic?", "criteria": criteria}, tuple("ABCD"))
    texts = ["my card has not come", "give me my money back", "someone took my card"]
    dataset = Dataset("toy", "test", task, tuple(Item(str(i), text, i) for i, text in enumerate(texts)))
    out = tmp_path / "run"
    evaluate_model(dataset, out, decider, seed=1, shuffle_seed=2, progress=False)
    assert json.loads((out / "run.json").read_text())["shuffle_options"] == 2
    shuffled = shuffle_options(task, 2)
    sent = DeciderPredictor(decider, task, {"x_seed": 1}, shuffled).request(dataset.items[0])
    assert list(sent["questions"]["answer"]["criteria"]) == list(shuffled["criteria"]) != list(criteria)
    rows = list(csv.DictReader((out / "predictions.csv").read_text().splitlines()))
    assert list(rows[0])[-4:] == ["p:A", "p:B", "p:C", "p:D"]
    for row, item in zip(rows, dataset.items, strict=True):
        answer = decider.decide(build_request(task, item, {"x_seed": 1}, shuffled))["answers"]["answer"]
        # class k is option k of the dataset's order, whatever order the prompt showed
        for name, option in zip("ABCD", criteria, strict=True):
            assert float(row[f"p:{name}"]) == answer["probabilities"][option]
    plain = decider.decide(build_request(task, dataset.items[0], {"x_seed": 1}))["answers"]["answer"]
    assert plain["probabilities"] != decider.decide(sent)["answers"]["answer"]["probabilities"]  # the order matters


def test_a_run_with_x_coverage_records_each_set_and_reports_coverage(smollm2: LoadedModel, tmp_path: Path) -> None:
    criteria = {"card arrival": None, "request refund": None, "lost or stolen card": None}
    task = Task("choice", {"type": "choice", "instructions": "Which topic?", "criteria": criteria}, tuple("ABC"))
    texts = ["my card has not come", "give me my money back", "someone took my card", "where is my new card"]
    dataset = Dataset("toy", "test", task, tuple(Item(str(i), text, i % 3) for i, text in enumerate(texts)))
    artifacts = tmp_path / "calibration"
    calibrate(Decider(smollm2), dataset).calibration.save(artifacts / "toy.json")
    decider = Decider(smollm2, calibration_dir=artifacts)
    out = tmp_path / "run"
    fields = {"x_coverage": 0.5}
    metrics = evaluate_model(dataset, out, decider, request_fields=fields, progress=False)
    rows = list(csv.DictReader((out / "predictions.csv").read_text().splitlines()))
    sets = []
    for row, item in zip(rows, dataset.items, strict=True):
        answer = decider.decide(build_request(task, item, {"x_seed": 0, **fields}))["answers"]["answer"]
        members = json.loads(row["set"])
        assert [list(criteria)[k] for k in members] == answer["x_set"]  # the served set, as class indices
        sets.append(members)
    covered = [item.gold in members for members, item in zip(sets, dataset.items, strict=True)]
    assert metrics["coverage"] == pytest.approx(np.mean(covered))
    assert metrics["mean_set_size"] == pytest.approx(np.mean([len(m) for m in sets]))


def test_a_concurrent_run_writes_the_same_rows_in_item_order(tmp_path: Path) -> None:
    info = run_info(DATASET, "scripted", {"x_seed": 0})
    alone = run(DATASET, tmp_path / "alone", info, Scripted, progress=False)
    together = run(DATASET, tmp_path / "together", info, Scripted, progress=False, concurrency=4)
    timing = {"latency_p50_ms", "latency_p95_ms"}
    assert {k: v for k, v in together.items() if k not in timing} == {k: v for k, v in alone.items() if k not in timing}
    rows = list(csv.DictReader((tmp_path / "together" / "predictions.csv").read_text().splitlines()))
    assert [row["id"] for row in rows] == ["0", "1", "2", "3", "4", "5"]


def test_concurrent_decisions_answer_as_one_at_a_time(smollm2: LoadedModel, urgent: Dataset, tmp_path: Path) -> None:
    """Four decisions in flight share engine calls through the batcher; on the CPU the answers are the same."""
    alone = evaluate_model(urgent, tmp_path / "alone", Decider(smollm2), progress=False)
    concurrent = Decider(smollm2)
    together = evaluate_model(urgent, tmp_path / "together", concurrent, progress=False, concurrency=4)
    assert isinstance(concurrent.engine, BatchingEngine)
    assert together["accuracy"] == alone["accuracy"]
    first, second = (
        list(csv.DictReader((tmp_path / name / "predictions.csv").read_text().splitlines()))
        for name in ("alone", "together")
    )
    assert [row["p:yes"] for row in first] == [row["p:yes"] for row in second]
    with pytest.raises(EvalError, match="at least 1"):
        evaluate_model(urgent, tmp_path / "none", concurrent, concurrency=0)
