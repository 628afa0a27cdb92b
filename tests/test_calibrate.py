"""Fitting a calibration from labelled data on SmolLM2, through the Python API and the command line."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotread.cli import main
from slotread.core.aggregate import softmax
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.eval.datasets import Dataset, Item, Task, normalised
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.training import drop_overlap, refuse_overlap
from slotread.models.load import LoadedModel
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.methods import T_MAX, T_MIN, apply_top_label_bins, mean_nll
from slotread.quality.calibration.train import calibrate

QUESTION: dict[str, Any] = {
    "type": "choice",
    "instructions": "What does the customer want?",
    "criteria": {"refund": "money back", "card": "a new or missing card", "other": None},
}
TASK = Task("choice", QUESTION, ("refund", "card", "other"))
DATA = Dataset(
    "train.csv",
    None,
    TASK,
    (
        Item("a", "I want my money back for this order.", 0),
        Item("b", "My card never arrived.", 1),
        Item("c", "What are your opening hours?", 2),
    ),
)


def test_a_fit_holds_the_temperature_content_free_reads_and_conformal_scores(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    fit = calibrate(decider, DATA, request_fields={"x_permutations": 2})
    artifact = fit.calibration
    assert fit.logits.shape == (3, 2, 3) and fit.gold.tolist() == [0, 1, 2]
    # the raw reads are the ones a plain request makes
    body = {"state": DATA.items[0].state, "questions": {"answer": QUESTION}, "x_permutations": 2}
    plain = decider.answer(body).answers["answer"]
    assert plain is not None and np.stack([r.logits for r in plain.reads]) == pytest.approx(fit.logits[0])
    # the fitted temperature is the NLL's minimum (SmolLM2 may push it to a bound)
    temperature = artifact.temperature
    assert temperature is not None
    best = mean_nll(fit.logits, fit.gold, temperature)
    assert best <= mean_nll(fit.logits, fit.gold, min(temperature * 1.05, T_MAX)) + 1e-9
    assert best <= mean_nll(fit.logits, fit.gold, max(temperature / 1.05, T_MIN)) + 1e-9
    assert best <= fit.summary()["nll_raw"] and fit.summary()["nll_fitted"] == pytest.approx(best)
    assert sorted(artifact.content_free) == [0, 1] and artifact.model == decider.name
    assert artifact.fitted_on["ids"] == ["a", "b", "c"] and artifact.fitted_on["data"] == "train.csv"
    assert artifact.permutations == 2 and artifact.options == ("refund", "card", "other")
    mean = softmax(fit.logits).mean(axis=1)
    assert fit.summary()["accuracy"] == pytest.approx(float((mean.argmax(axis=1) == fit.gold).mean()))
    # conformal scores 1 − p(gold) of the answer each method gives
    items = np.arange(3)
    assert sorted(artifact.conformal) == ["binned", "contextual", "none", "temperature"]
    assert artifact.conformal["none"] == pytest.approx(1 - mean[items, fit.gold])
    scaled = softmax(fit.logits / temperature).mean(axis=1)
    assert artifact.conformal["temperature"] == pytest.approx(1 - scaled[items, fit.gold])
    divided = softmax(fit.logits) / np.stack([artifact.content_free[0], artifact.content_free[1]])
    contextual = (divided / divided.sum(axis=2, keepdims=True)).mean(axis=1)
    assert artifact.conformal["contextual"] == pytest.approx(1 - contextual[items, fit.gold])
    # 3 items make one bin: every top becomes (right + 1)/(3 + 2)
    right = int((contextual.argmax(axis=1) == fit.gold).sum())
    assert artifact.bins is not None and artifact.bins.values.tolist() == pytest.approx([(right + 1) / 5])
    binned = apply_top_label_bins(contextual, artifact.bins)
    assert artifact.conformal["binned"] == pytest.approx(1 - binned[items, fit.gold])
    assert artifact.fitted_on["ece"]["contextual"] == pytest.approx(expected_calibration_error(contextual, fit.gold))
    assert artifact.fitted_on["ece"]["binned"] == pytest.approx(expected_calibration_error(binned, fit.gold))


def test_overlapping_data_is_refused_before_reading(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    test = Dataset("banking77", "test", TASK, (Item("0", "  my CARD never arrived. ", 1),))
    with pytest.raises(InvalidRequest) as caught:
        calibrate(decider, DATA, exclude=test)
    (problem,) = caught.value.detail
    assert problem["loc"] == ["data"] and "1 of 3 items of train.csv also appear in banking77 test" in problem["msg"]


def test_drop_overlap_leaves_out_the_excluded_texts() -> None:
    test = Dataset("banking77", "test", TASK, (Item("0", "  my CARD never arrived. ", 1),))
    kept, dropped = drop_overlap(DATA, test)
    assert dropped == 1 and len(kept.items) == len(DATA.items) - 1
    assert all(normalised(item.state) != "my card never arrived." for item in kept.items)
    refuse_overlap(kept, test)  # nothing left to refuse


def test_the_command_writes_the_artifact_and_refuses_overlap_with_exit_2(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q.json").write_text(json.dumps(QUESTION))
    rows = [{"id": item.id, "text": item.state, "label": TASK.classes[item.gold]} for item in DATA.items[:2]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "test.csv").write_text("text,label\nMy card never arrived.,card\n")
    command = ["--cache-dir", str(cache_dir), "calibrate", "--model", smollm2.name, "--question"]
    command += [str(tmp_path / "q.json"), "--dataset", str(tmp_path / "train.jsonl")]
    command += ["--out", str(tmp_path / "cal.json"), "--request-field", "x_permutations=2"]
    assert main([*command, "--exclude", str(tmp_path / "test.csv")]) == 2
    captured = capsys.readouterr()
    assert "also appear in" in captured.err and not (tmp_path / "cal.json").exists()
    assert "--drop-overlap" in captured.err  # the error names the way out
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "in-sample ECE" in printed and "binned (1 bins)" in printed
    artifact = Calibration.load(tmp_path / "cal.json")
    assert artifact.fitted_on["items"] == 2 and artifact.permutations == 2 and artifact.temperature is not None
    # the data's label prior is recorded as it was (an empty class as 0)
    assert artifact.fitted_on["balanced"] is False
    assert artifact.fitted_on["class_counts"] == {"refund": 1, "card": 1, "other": 0}


def test_balance_fits_on_the_same_count_of_every_class_and_refuses_a_missing_class_with_exit_1(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q.json").write_text(json.dumps(QUESTION))
    texts = [
        ("I want my money back", "refund"),
        ("Refund my order please", "refund"),
        ("Give me a refund now", "refund"),
        ("My card never arrived", "card"),
        ("I lost my card", "card"),
        ("What are your opening hours", "other"),
        ("Do you sell shoes", "other"),
    ]
    rows = [{"id": f"r{i}", "text": text, "label": label} for i, (text, label) in enumerate(texts)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "refunds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:5]))
    command = [
        "--cache-dir",
        str(cache_dir),
        "calibrate",
        "--model",
        smollm2.name,
        "--question",
        str(tmp_path / "q.json"),
    ]
    # no 'other' item: nothing to balance against, refused before the model loads
    missing = [*command, "--dataset", str(tmp_path / "refunds.jsonl"), "--balance", "--out", str(tmp_path / "no.json")]
    assert main(missing) == 1
    err = capsys.readouterr().err
    assert "has no items of class 'other' (of 3 classes)" in err and "Traceback" not in err
    assert not (tmp_path / "no.json").exists()
    # --limit 4 over 3 classes: 4 // 3 = 1 item of each class
    assert (
        main(
            [
                *command,
                "--dataset",
                str(tmp_path / "train.jsonl"),
                "--balance",
                "--limit",
                "4",
                "--out",
                str(tmp_path / "cal.json"),
            ]
        )
        == 0
    )
    assert "3 items (1 of each class)" in capsys.readouterr().out
    fitted_on = Calibration.load(tmp_path / "cal.json").fitted_on
    assert fitted_on["balanced"] is True and fitted_on["class_counts"] == {"refund": 1, "card": 1, "other": 1}
    assert fitted_on["items"] == 3 and fitted_on["sample"] == [3, 0]
