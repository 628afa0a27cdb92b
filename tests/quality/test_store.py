"""The calibration store: batch priors by hand, bounds, threads, and artifacts on disk."""

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slotread.errors import CalibrationError
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.store import BatchPriors, CalibrationStore


def test_batch_priors_by_hand() -> None:
    priors = BatchPriors(pseudo_count=2, window=3)
    first = priors.priors_then_update(["k"], np.array([[0.9, 0.1]]))
    assert first == pytest.approx(np.array([[0.5, 0.5]]))  # nothing seen yet: uniform
    # one answer seen: m = (1·[0.9, 0.1] + 2·[0.5, 0.5]) / 3
    second = priors.priors_then_update(["k"], np.array([[0.3, 0.7]]))
    assert second == pytest.approx(np.array([[1.9 / 3, 1.1 / 3]]))
    # two seen, mean [0.6, 0.4]: m = (2·[0.6, 0.4] + 2·[0.5, 0.5]) / 4
    assert priors.priors_then_update(["other"], np.array([[0.5, 0.5]])) == pytest.approx(np.array([[0.5, 0.5]]))
    assert priors.priors_then_update(["k"], np.array([[0.6, 0.4]])) == pytest.approx(np.array([[0.55, 0.45]]))


def test_batch_priors_turn_exponential_after_the_window() -> None:
    priors = BatchPriors(pseudo_count=1, window=2)
    for p in ([1.0, 0.0], [0.0, 1.0], [1.0, 0.0]):
        priors.priors_then_update(["k"], np.array([p]))
    # means: [1, 0] -> [0.5, 0.5] -> [0.5, 0.5] + ([1, 0] - [0.5, 0.5]) / 2 = [0.75, 0.25]; N = 2
    got = priors.priors_then_update(["k"], np.array([[0.5, 0.5]]))
    assert got == pytest.approx(np.array([[(2 * 0.75 + 0.5) / 3, (2 * 0.25 + 0.5) / 3]]))


def test_reads_of_one_answer_see_the_priors_before_it() -> None:
    priors = BatchPriors(pseudo_count=1)
    got = priors.priors_then_update(["k", "k"], np.array([[1.0, 0.0], [1.0, 0.0]]))
    assert got == pytest.approx(np.full((2, 2), 0.5))


def test_batch_priors_forget_the_least_recent_keys() -> None:
    priors = BatchPriors(max_keys=2)
    for key in ("a", "b", "a", "c"):
        priors.priors_then_update([key], np.array([[1.0, 0.0]]))
    assert len(priors) == 2
    assert priors.priors_then_update(["a"], np.array([[1.0, 0.0]]))[0, 0] > 0.5  # kept
    assert priors.priors_then_update(["b"], np.array([[1.0, 0.0]])) == pytest.approx(np.full((1, 2), 0.5))  # forgotten


def test_batch_priors_lose_no_update_under_threads() -> None:
    priors = BatchPriors(pseudo_count=1, window=10**6)

    def feed() -> None:
        for _ in range(200):
            priors.priors_then_update(["k"], np.array([[1.0, 0.0]]))

    threads = [threading.Thread(target=feed) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # N answers of [1, 0]: m_0 = (N + 0.5) / (N + 1)
    assert priors.priors_then_update(["k"], np.array([[1.0, 0.0]]))[0, 0] == pytest.approx(1600.5 / 1601, abs=1e-12)


def artifact(model: str = "m", schema: str = "ab" * 32, **fields: object) -> Calibration:
    return replace(Calibration(model, schema, "noul", ("yes", "no")), **fields)


def test_a_directory_loads_this_model_s_artifacts(tmp_path: Path) -> None:
    artifact(temperature=2.0).save(tmp_path / "a.json")
    artifact(model="other", temperature=3.0).save(tmp_path / "b.json")
    (tmp_path / "notes.txt").write_text("not an artifact")
    store = CalibrationStore("m", tmp_path)
    fitted = store.artifact("ab" * 32)
    assert fitted is not None and fitted.temperature == 2.0
    assert store.artifact("cd" * 32) is None and CalibrationStore("m").artifact("ab" * 32) is None


def test_two_artifacts_for_one_schema_are_refused(tmp_path: Path) -> None:
    artifact(temperature=2.0).save(tmp_path / "a.json")
    artifact(temperature=3.0).save(tmp_path / "b.json")
    with pytest.raises(CalibrationError, match=r"a\.json.*both calibrate|b\.json.*both calibrate"):
        CalibrationStore("m", tmp_path)


def test_content_free_reads_are_kept_and_written_back(tmp_path: Path) -> None:
    artifact(temperature=2.0, content_free={0: np.array([0.6, 0.4])}).save(tmp_path / "fitted.json")
    store = CalibrationStore("m", tmp_path)
    store.learn_content_free(artifact(content_free={1: np.array([0.3, 0.7])}, content_free_states=("N/A",)))
    new_schema = "cd" * 32
    store.learn_content_free(artifact(schema=new_schema, content_free={0: np.array([0.5, 0.5])}))
    assert sorted(store.content_free("ab" * 32)) == [0, 1]
    # a restarted server finds both on disk, the fitted temperature kept
    again = CalibrationStore("m", tmp_path)
    merged = again.artifact("ab" * 32)
    assert merged is not None and merged.temperature == 2.0 and sorted(merged.content_free) == [0, 1]
    assert again.content_free(new_schema)[0].tolist() == [0.5, 0.5]
    assert (tmp_path / f"m.{new_schema[:16]}.json").exists()


def test_without_a_directory_content_free_reads_stay_in_memory() -> None:
    store = CalibrationStore("m")
    store.learn_content_free(artifact(content_free={0: np.array([0.6, 0.4])}))
    store.learn_content_free(artifact(content_free={1: np.array([0.2, 0.8])}))
    assert {s: p.tolist() for s, p in store.content_free("ab" * 32).items()} == {0: [0.6, 0.4], 1: [0.2, 0.8]}


def test_a_failed_write_back_is_logged_and_the_reads_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CalibrationStore("m", tmp_path)
    store.directory_path("ab" * 32).write_text("{broken")  # appeared after start-up
    store.learn_content_free(artifact(content_free={0: np.array([0.6, 0.4])}))
    assert store.content_free("ab" * 32)[0].tolist() == [0.6, 0.4]
    assert "not written" in caplog.text and "cannot read it as JSON" in caplog.text
