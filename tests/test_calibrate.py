"""Fitting a calibration from labelled data on SmolLM2, through the Python API and the command line."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotread.calibrate import LabelledItem, calibrate, read_labelled
from slotread.cli import main
from slotread.core.aggregate import softmax
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.models.load import LoadedModel
from slotread.quality.artifact import Calibration
from slotread.quality.calibration import T_MAX, T_MIN, mean_nll

QUESTIONS: dict[str, Any] = {
    "questions": {
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": {"refund": "money back", "card": "a new or missing card", "other": None},
        }
    }
}
ITEMS = [
    LabelledItem("a", "I want my money back for this order.", "refund"),
    LabelledItem("b", "My card never arrived.", "card"),
    LabelledItem("c", "What are your opening hours?", "other"),
    LabelledItem("d", "Please refund the double charge.", "refund"),
    LabelledItem("e", "I lost my card yesterday.", "card"),
]


def test_labelled_items_come_from_csv_or_jsonl(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text('text,category\n"Hi, there",refund\n')
    (tmp_path / "d.jsonl").write_text('{"id": 7, "text": "Hi", "label": true}\n\n')
    (item,) = read_labelled(tmp_path / "d.csv", label_column="category")
    assert item.text == "Hi, there" and item.label == "refund" and item.id.startswith("sha256:")
    assert read_labelled(tmp_path / "d.jsonl") == [LabelledItem("7", "Hi", True)]
    with pytest.raises(InvalidRequest, match="no 'label' column"):
        read_labelled(tmp_path / "d.csv")


def test_a_fit_holds_the_temperature_content_free_reads_and_what_it_was_fitted_on(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    fit = calibrate(decider, {**QUESTIONS, "x_permutations": 2}, ITEMS[:3], data="train.csv")
    artifact = fit.calibration
    assert fit.logits.shape == (3, 2, 3) and fit.gold.tolist() == [0, 1, 2]
    # the raw reads are the ones a plain request makes
    plain = decider.answer({**QUESTIONS, "state": ITEMS[0].text, "x_permutations": 2}).answers["intent"]
    assert plain is not None and np.stack([r.logits for r in plain.reads]) == pytest.approx(fit.logits[0])
    # the fitted temperature is the NLL's minimum
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
    assert sorted(artifact.conformal) == ["contextual", "none", "temperature"]
    assert artifact.conformal["none"] == pytest.approx(1 - mean[items, fit.gold])
    scaled = softmax(fit.logits / temperature).mean(axis=1)
    assert artifact.conformal["temperature"] == pytest.approx(1 - scaled[items, fit.gold])
    divided = softmax(fit.logits) / np.stack([artifact.content_free[0], artifact.content_free[1]])
    contextual = (divided / divided.sum(axis=2, keepdims=True)).mean(axis=1)
    assert artifact.conformal["contextual"] == pytest.approx(1 - contextual[items, fit.gold])


def test_overlapping_data_and_unknown_labels_are_refused_before_reading(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    with pytest.raises(InvalidRequest) as caught:
        calibrate(decider, QUESTIONS, ITEMS, exclude=["  my CARD never arrived. "], excluded="test.csv")
    (problem,) = caught.value.detail
    assert problem["loc"] == ["data"] and "1 of 5 items also appear in the excluded split test.csv" in problem["msg"]
    with pytest.raises(InvalidRequest) as caught:
        calibrate(decider, QUESTIONS, [*ITEMS, LabelledItem("f", "?", "Refund")])
    assert [d["loc"] for d in caught.value.detail] == [["data", 5, "label"]]
    with pytest.raises(InvalidRequest, match="name the one"):
        calibrate(decider, {"questions": {**QUESTIONS["questions"], "b": {"type": "noul"}}}, ITEMS)


def test_the_command_writes_the_artifact_and_refuses_overlap_with_exit_2(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(vars(item)) + "\n" for item in ITEMS[:2]))
    (tmp_path / "test.csv").write_text("text,label\nMy card never arrived.,card\n")
    command = ["--cache-dir", str(cache_dir), "calibrate", "--model", smollm2.name, "--questions"]
    command += [str(tmp_path / "q.json"), "--data", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "cal.json")]
    assert main([*command, "--exclude", str(tmp_path / "test.csv")]) == 2
    captured = capsys.readouterr()
    assert "excluded split" in captured.err and not (tmp_path / "cal.json").exists()
    assert main(command) == 0
    assert "wrote" in capsys.readouterr().out
    artifact = Calibration.load(tmp_path / "cal.json")
    assert artifact.fitted_on["items"] == 2 and artifact.temperature is not None
