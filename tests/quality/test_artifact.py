"""Calibration artifacts: the schema hash, the JSON round trip, and refusals naming the file."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slotread.core.questions import Option, Question
from slotread.errors import CalibrationError
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.methods import TopLabelBins

QUESTION = Question("intent", "choice", "What do they want?", (Option("refund", "money back"), Option("other")))


def test_the_schema_is_what_the_prompt_shows_besides_the_state() -> None:
    base = schema_hash(QUESTION, "Be brief.")
    assert len(base) == 64 and base == schema_hash(QUESTION, "Be brief.")
    assert schema_hash(replace(QUESTION, id="renamed", depends_on=("x",)), "Be brief.") == base
    assert schema_hash(QUESTION, None) != base
    assert schema_hash(replace(QUESTION, instructions="Why?"), "Be brief.") != base
    swapped = replace(QUESTION, options=QUESTION.options[::-1])
    described = replace(QUESTION, options=(Option("refund", "a refund"), Option("other")))
    assert len({base, schema_hash(swapped, "Be brief."), schema_hash(described, "Be brief.")}) == 3


def test_the_schema_hash_is_sha256_of_the_schemas_sorted_compact_json() -> None:
    """Fitted artifacts on disk are named by it: the remembered hashes are the format's, computed here."""
    payload = {
        "type": "choice",
        "instructions": "What do they want?",
        "options": [["refund", "money back"], ["other", None]],
        "request_instructions": "Be brief. é",
    }
    text = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    expected = hashlib.sha256(text.encode()).hexdigest()
    assert schema_hash(QUESTION, "Be brief. é") == expected
    assert schema_hash(replace(QUESTION, id="again"), "Be brief. é") == expected  # remembered


def artifact() -> Calibration:
    return Calibration(
        model="m",
        schema="ab" * 32,
        kind="choice",
        options=("refund", "other"),
        temperature=1.5,
        content_free={0: np.array([0.7, 0.3]), 1: np.array([0.4, 0.6])},
        content_free_states=("N/A", ""),
        bins=TopLabelBins(np.array([0.6]), np.array([0.55, 0.8]), np.array([40.0, 41.0])),
        conformal={"none": np.array([0.1, 0.5, 0.9]), "temperature": np.array([0.2, 0.4, 0.8])},
        fitted_on={"items": 3, "request": {"x_permutations": 2}},
    )


def test_an_artifact_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    artifact().save(path)
    loaded = Calibration.load(path)
    assert loaded.to_json() == artifact().to_json()
    assert loaded.content_free[1].tolist() == [0.4, 0.6] and loaded.permutations == 2
    assert loaded.conformal["temperature"].tolist() == [0.2, 0.4, 0.8]
    assert json.loads(path.read_text())["methods"]["temperature"] == {"temperature": 1.5}
    assert loaded.bins is not None and loaded.bins.values.tolist() == [0.55, 0.8]
    assert json.loads(path.read_text())["methods"]["binned"] == {
        "edges": [0.6],
        "values": [0.55, 0.8],
        "counts": [40, 41],
    }
    assert list(tmp_path.iterdir()) == [path]  # the temporary file was renamed into place


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"format": "other/1"}, "format"),
        ({"methods": {"temperature": {"temperature": -1}}}, "temperature"),
        ({"methods": {"contextual": {"content_free": {"0": [0.5, 0.6]}}}}, "content_free"),
        ({"question": {"type": "choice"}}, "options"),
        ({"conformal": {"none": [0.5, 1.5]}}, "conformal"),
        ({"conformal": {"batch": [0.5]}}, "conformal"),
        ({"methods": {"binned": {"edges": [0.6], "values": [0.5], "counts": [3]}}}, "binned"),
        ({"methods": {"binned": {"edges": [0.6], "values": [0.8, 0.5], "counts": [3, 3]}}}, "binned"),
    ],
)
def test_a_broken_artifact_is_refused_naming_its_file(tmp_path: Path, change: dict, problem: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({**artifact().to_json(), **change}))
    with pytest.raises(CalibrationError, match=problem) as caught:
        Calibration.load(path)
    assert str(path) in str(caught.value)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match=r"broken\.json"):
        Calibration.load(path)


def test_an_artifact_without_bins_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    old = artifact().to_json()
    del old["methods"]["binned"]
    path.write_text(json.dumps(old))
    assert Calibration.load(path).bins is None
