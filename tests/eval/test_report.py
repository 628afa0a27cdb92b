"""Reports from hand-made run folders: metrics.json, the table, and paired comparison with McNemar."""

import json
from pathlib import Path

import numpy as np
import pytest

from slotread.errors import EvalError
from slotread.eval.datasets import Dataset, Item, Task
from slotread.eval.predictions import Prediction
from slotread.eval.report import compare, format_comparison, format_table
from slotread.eval.runner import run, run_info

TASK = Task("choice", {"type": "choice", "criteria": {"a": None, "b": None}}, ("A", "B"))
DATASET = Dataset("toy", "test", TASK, tuple(Item(str(i), f"s{i}", i % 2) for i in range(10)))


def hand_made_run(out: Path, system: str, right: set[int], dataset: Dataset = DATASET) -> Path:
    """A finished run whose predictions are right on exactly the items in ``right``, at confidence 0.9."""

    def predict(item: Item) -> Prediction:
        top = item.gold if int(item.id) in right else 1 - item.gold
        return Prediction(np.array([0.9, 0.1]) if top == 0 else np.array([0.1, 0.9]), reads=1)

    run(dataset, out, run_info(dataset, system, {"x_seed": 0}), lambda: predict, progress=False)
    return out


def test_compare_pairs_the_items_and_tests_them_exactly(tmp_path: Path) -> None:
    # A right on 0-7, B right on 0, 1 and 8: only A right on 2-7 (6), only B right on 8 (1)
    # exact McNemar, n = 7: 2 * (C(7,0) + C(7,1)) / 2^7 = 0.125
    a = hand_made_run(tmp_path / "a", "model-a", set(range(8)))
    b = hand_made_run(tmp_path / "b", "model-b", {0, 1, 8})
    comparison = compare(a, b)
    assert (comparison.items, comparison.a_only, comparison.b_only) == (10, 6, 1)
    assert comparison.accuracy_a == pytest.approx(0.8) and comparison.accuracy_b == pytest.approx(0.3)
    assert comparison.p_value == pytest.approx(0.125)
    # two classes: the predictions differ exactly where one run is right and the other wrong (2-8)
    assert comparison.flips == 7 and comparison.flip_rate == pytest.approx(0.7)
    text = format_comparison(comparison)
    assert "difference (A - B): +0.500" in text and "exact McNemar p = 0.125" in text
    assert "predicted class differs (flip rate): 0.700 (7 of 10)" in text


def test_the_flip_rate_counts_changed_predictions_right_or_wrong(tmp_path: Path) -> None:
    task = Task("choice", {"type": "choice", "criteria": {"a": None, "b": None, "c": None}}, ("A", "B", "C"))
    dataset = Dataset("toy", "test", task, tuple(Item(str(i), f"s{i}", 0) for i in range(5)))
    # predicted classes, items 0-4: A -> 0, 1, 2, 0, 1; B -> 0, 2, 1, 1, 1
    # item 1 (1 -> 2) and item 2 (2 -> 1) flip while both runs are wrong; item 3 (0 -> 1) flips right to wrong
    # -> 3 flips of 5, one discordant pair (only A right on item 3)
    picks = {"a": [0, 1, 2, 0, 1], "b": [0, 2, 1, 1, 1]}

    def runs(name: str) -> Path:
        def predict(item: Item) -> Prediction:
            p = np.full(3, 0.2)
            p[picks[name][int(item.id)]] = 0.6
            return Prediction(p)

        run(dataset, tmp_path / name, run_info(dataset, name, {"x_seed": 0}), lambda: predict, progress=False)
        return tmp_path / name

    comparison = compare(runs("a"), runs("b"))
    assert (comparison.flips, comparison.a_only, comparison.b_only) == (3, 1, 0)
    assert comparison.flip_rate == pytest.approx(0.6)


def test_compare_uses_only_the_items_both_runs_have(tmp_path: Path) -> None:
    a = hand_made_run(tmp_path / "a", "model-a", set(range(8)))
    first_four = Dataset("toy", "test", TASK, DATASET.items[:4], sample=(4, 0))
    b = hand_made_run(tmp_path / "b", "model-b", set(), first_four)
    comparison = compare(a, b)
    assert (comparison.items, comparison.a_only, comparison.b_only) == (4, 4, 0)
    assert comparison.p_value == pytest.approx(0.125)  # 2 / 2^4


def test_compare_refuses_runs_on_other_data(tmp_path: Path) -> None:
    a = hand_made_run(tmp_path / "a", "model-a", set())
    other = Dataset("toy", "val", TASK, DATASET.items)
    with pytest.raises(EvalError, match="different data"):
        compare(a, hand_made_run(tmp_path / "b", "model-b", set(), other))
    relabelled = Dataset("toy", "test", TASK, tuple(Item(i.id, i.state, 1 - i.gold) for i in DATASET.items))
    with pytest.raises(EvalError, match="gold label"):
        compare(a, hand_made_run(tmp_path / "c", "model-b", set(), relabelled))
    with pytest.raises(EvalError, match="not a run folder"):
        compare(a, tmp_path / "nothing")


def test_compare_pairs_a_run_on_a_file_with_a_run_on_a_subset_of_it(tmp_path: Path) -> None:
    whole = Dataset(str(tmp_path / "data.jsonl"), None, TASK, DATASET.items)
    part = Dataset(str(tmp_path / "part.jsonl"), None, TASK, DATASET.items[2:6])  # items keep their ids
    a = hand_made_run(tmp_path / "a", "model-a", set(range(8)), whole)
    comparison = compare(a, hand_made_run(tmp_path / "b", "model-b", set(), part))
    assert (comparison.items, comparison.a_only, comparison.b_only) == (4, 4, 0)
    other = Task("choice", {"type": "choice", "criteria": {"x": None, "y": None}}, ("X", "Y"))
    elsewhere = Dataset(str(tmp_path / "other.jsonl"), None, other, DATASET.items)
    with pytest.raises(EvalError, match="different classes"):
        compare(a, hand_made_run(tmp_path / "c", "model-b", set(), elsewhere))
    with pytest.raises(EvalError, match="different data"):  # a file beside a built-in set's split
        compare(a, hand_made_run(tmp_path / "d", "model-b", set()))


def test_a_readout_run_is_labelled_apart_from_plain_reads(tmp_path: Path) -> None:
    plain = hand_made_run(tmp_path / "plain", "model-a", set())
    readout = tmp_path / "readout"
    run(
        DATASET,
        readout,
        run_info(DATASET, "model-a", {"x_readout": True}),
        lambda: lambda item: Prediction(np.array([0.5, 0.5])),
        progress=False,
    )
    systems = [json.loads((out / "metrics.json").read_text())["system"] for out in (plain, readout)]
    assert systems == ["model-a", "model-a readout"]
    assert compare(plain, readout).system_b == "model-a readout"
    assert "| model-a readout |" in format_table([json.loads((readout / "metrics.json").read_text())])


def test_the_reliability_title_wraps_a_long_file_path(tmp_path: Path) -> None:
    long_path = tmp_path / ("a-rather-long-folder-name-" * 3) / "customer-messages-labelled-by-hand.jsonl"
    dataset = Dataset(str(long_path), None, TASK, DATASET.items)
    out = hand_made_run(tmp_path / "run", "qwen2.5-coder-1.5b-instruct", set(range(5)), dataset)
    from PIL import Image  # matplotlib's own dependency

    pixels = np.asarray(Image.open(out / "reliability.png").convert("L"))
    # the title's ink stays off the image's left and right edges: nothing is cut off
    assert pixels[:60, :3].min() > 200 and pixels[:60, -3:].min() > 200


def test_metrics_json_of_a_hand_made_run(tmp_path: Path) -> None:
    out = hand_made_run(tmp_path / "a", "model-a", set(range(8)))
    metrics = json.loads((out / "metrics.json").read_text())
    # 10 items at confidence 0.9, 8 right: one bin, ECE |0.8 - 0.9| = 0.1
    # Brier: right 0.1^2 * 2 = 0.02, wrong 0.9^2 + 0.9^2 = 1.62 -> (8 * 0.02 + 2 * 1.62) / 10 = 0.34
    # NLL: -(8 ln 0.9 + 2 ln 0.1) / 10
    assert metrics["accuracy"] == pytest.approx(0.8) and metrics["ece"] == pytest.approx(0.1)
    assert metrics["brier"] == pytest.approx(0.34)
    assert metrics["nll"] == pytest.approx(-(8 * np.log(0.9) + 2 * np.log(0.1)) / 10)
    assert (metrics["system"], metrics["dataset"], metrics["split"], metrics["items"]) == ("model-a", "toy", "test", 10)
    assert "qwk" not in metrics and "oos_precision" not in metrics


def test_undefined_metrics_are_null_in_metrics_json(tmp_path: Path) -> None:
    task = Task("choice", {"type": "choice", "criteria": {"a": None, "b": None}}, ("A", "oos"), positive="oos")
    dataset = Dataset("toy", "test", task, tuple(Item(str(i), "s", 0) for i in range(3)))
    out = hand_made_run(tmp_path / "a", "model-a", {0, 1, 2}, dataset)  # never predicts out of scope
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["oos_precision"] is None and metrics["oos_recall"] is None


def test_metrics_json_reports_coverage_and_set_size_of_a_run_with_sets(tmp_path: Path) -> None:
    # items 0-9, gold i % 2; the set is both classes for items 0-2, {0} for the rest:
    # gold in set for 0, 1, 2 and the even items 4, 6, 8 -> coverage 6 / 10; sizes 3 * 2 + 7 * 1 = 13 -> 1.3
    def predict(item: Item) -> Prediction:
        members = (0, 1) if int(item.id) < 3 else (0,)
        return Prediction(np.array([0.6, 0.4]), reads=1, prediction_set=members)

    out = tmp_path / "a"
    run(DATASET, out, run_info(DATASET, "model-a", {"x_coverage": 0.9}), lambda: predict, progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["coverage"] == pytest.approx(0.6) and metrics["mean_set_size"] == pytest.approx(1.3)
    table = format_table([metrics]).splitlines()
    assert table[0].endswith("| reads | coverage | set size |") and table[2].endswith("| 1.00 | 0.600 | 1.30 |")


def test_format_table_shows_the_columns_any_run_has() -> None:
    runs = [
        {
            "system": "m",
            "dataset": "sst5",
            "split": "test",
            "items": 4,
            "accuracy": 0.5,
            "qwk": 0.25,
            "latency_p50_ms": 12.3,
        },
        {"system": "tfidf-logreg", "dataset": "sst5", "split": "test", "items": 4, "accuracy": 0.75, "qwk": None},
    ]
    assert format_table(runs).splitlines() == [
        "| system | dataset | split | items | accuracy | QWK | p50 ms |",
        "|---|---|---|---:|---:|---:|---:|",
        "| m | sst5 | test | 4 | 0.500 | 0.250 | 12 |",
        "| tfidf-logreg | sst5 | test | 4 | 0.750 | n/a | n/a |",
    ]
