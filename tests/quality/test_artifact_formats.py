"""Artifacts written before the quality package was reorganised still load, and save back unchanged.

The files under ``artifacts/`` were written by the code of commit fc294c5 (one calibration artifact
with every part, one readout with all three partners); a reader of ``slotread-calibration/1`` or
``slotread-readout/1`` must keep reading them as they are.
"""

import json
from pathlib import Path

import numpy as np

from slotread.quality.calibration.artifact import Calibration
from slotread.quality.readouts.readout import Readout

ARTIFACTS = Path(__file__).parent / "artifacts"


def test_an_old_calibration_artifact_loads_and_saves_back_unchanged(tmp_path: Path) -> None:
    path = ARTIFACTS / "calibration" / "m.abababababababab.json"
    loaded = Calibration.load(path)
    assert (loaded.model, loaded.kind, loaded.options, loaded.temperature) == ("m", "choice", ("refund", "other"), 1.5)
    assert loaded.content_free[1].tolist() == [0.4, 0.6] and loaded.permutations == 2
    assert loaded.bins is not None and loaded.bins.edges.tolist() == [0.6]
    loaded.save(tmp_path / path.name)
    assert json.loads((tmp_path / path.name).read_text()) == json.loads(path.read_text())


def test_an_old_readout_artifact_loads_and_saves_back_unchanged(tmp_path: Path) -> None:
    path = ARTIFACTS / "readout" / "m.cdcdcdcdcdcdcdcd.readout.json"
    loaded = Readout.load(path)
    assert (loaded.model, loaded.schema, loaded.layout, loaded.hidden_size) == ("m", "cd" * 32, "schema_first", 3)
    assert (loaded.vote_neighbours, loaded.lexical_weight, loaded.encoder) == (4, 0.3, "all-MiniLM-L6-v2")
    saved = loaded.save(tmp_path)
    assert saved.name == path.name
    assert json.loads(saved.read_text()) == json.loads(path.read_text())
    with np.load(path.with_suffix(".npz")) as old, np.load(saved.with_suffix(".npz")) as new:
        assert sorted(old.files) == sorted(new.files)
        assert all(np.array_equal(old[name], new[name]) for name in old.files)
