"""predictions.csv: rows round-trip at full precision, and a row torn by a kill is dropped on reopening."""

from pathlib import Path

import numpy as np
import pytest

from slotread.errors import EvalError
from slotread.eval.predictions import Prediction, PredictionsFile, header, read_predictions

CLASSES = ("yes", "no")


def test_rows_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    p = np.array([0.1 + 0.2, 1 - (0.1 + 0.2)])
    with PredictionsFile(path, CLASSES) as file:
        file.append("a", 1, Prediction(p, reads=2, input_tokens=17, label_mass=0.5, entropy=0.9, stderr=0.01), 12.5)
        file.append("b", 0, Prediction(np.array([1.0, 0.0])), 3.0)
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(header(CLASSES))
    assert lines[0].endswith("stderr,set,p:yes,p:no")
    assert lines[1] == "a,no,no,1,12.5,2,17,0.5,0.9,0.01,,0.30000000000000004,0.7"
    assert lines[2] == "b,yes,yes,1,3.0,,,,,,,1.0,0.0"
    back = read_predictions(path)
    assert back.ids == ("a", "b") and back.classes == CLASSES
    assert back.probabilities[0, 0] == 0.1 + 0.2  # full precision
    assert back.gold.tolist() == [1, 0] and back.latency_ms.tolist() == [12.5, 3.0]
    assert back.reads is not None and np.isnan(back.reads[1])
    assert back.sets is None


def test_prediction_sets_round_trip_as_class_indices(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    with PredictionsFile(path, ("a", "b", "c")) as file:
        file.append("x", 2, Prediction(np.array([0.5, 0.1, 0.4]), prediction_set=(0, 2)), 1.0)
        file.append("y", 1, Prediction(np.array([0.5, 0.1, 0.4]), prediction_set=()), 1.0)
        file.append("z", 1, Prediction(np.array([0.5, 0.1, 0.4])), 1.0)
    assert path.read_text().splitlines()[1] == 'x,c,a,0,1.0,,,,,,"[0,2]",0.5,0.1,0.4'
    back = read_predictions(path)
    assert back.sets == ((0, 2), (), None)
    assert back.probabilities.tolist() == [[0.5, 0.1, 0.4]] * 3


def test_a_file_from_before_the_set_column_is_read_and_resumed(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    legacy = "id,gold,predicted,correct,latency_ms,reads,input_tokens,label_mass,entropy,stderr,p:yes,p:no"
    path.write_text(legacy + "\na,yes,no,0,2.0,1,5,,,,0.25,0.75\n")
    back = read_predictions(path)
    assert back.probabilities.tolist() == [[0.25, 0.75]] and back.sets is None and back.reads is not None
    with PredictionsFile(path, CLASSES) as file:
        assert file.done == {"a"}
        file.append("b", 0, Prediction(np.array([0.6, 0.4]), prediction_set=(0,)), 1.0)
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(header(CLASSES))
    assert lines[1] == "a,yes,no,0,2.0,1,5,,,,,0.25,0.75"
    back = read_predictions(path)
    assert back.ids == ("a", "b") and back.sets == (None, (0,))
    assert back.probabilities.tolist() == [[0.25, 0.75], [0.6, 0.4]]


def test_reads_are_none_when_no_row_has_them(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    with PredictionsFile(path, CLASSES) as file:
        file.append("a", 0, Prediction(np.array([0.6, 0.4])), 1.0)
    assert read_predictions(path).reads is None


def test_reopening_keeps_complete_rows_and_drops_a_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    with PredictionsFile(path, CLASSES) as file:
        file.append("a", 0, Prediction(np.array([0.6, 0.4])), 1.0)
    with path.open("a") as handle:
        handle.write("b,yes,yes,1,2.0,,,,,,0.7")  # killed before the newline
    assert read_predictions(path).ids == ("a",)
    with PredictionsFile(path, CLASSES) as file:
        assert file.done == {"a"}
        file.append("b", 0, Prediction(np.array([0.7, 0.3])), 2.0)
    assert read_predictions(path).ids == ("a", "b")
    assert len(path.read_text().splitlines()) == 3


def test_a_file_with_other_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "predictions.csv"
    with PredictionsFile(path, CLASSES) as file:
        file.append("a", 0, Prediction(np.array([0.6, 0.4])), 1.0)
    with pytest.raises(EvalError, match="other columns"):
        PredictionsFile(path, ("0", "1", "2"))


def test_reading_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="no predictions at"):
        read_predictions(tmp_path / "predictions.csv")
    PredictionsFile(tmp_path / "predictions.csv", CLASSES).close()
    with pytest.raises(EvalError, match="holds no predictions"):
        read_predictions(tmp_path / "predictions.csv")
