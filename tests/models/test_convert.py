"""The conversion marker: a checkpoint directory counts as converted only for its own source and dtype."""

import json
from pathlib import Path

import torch

from slotread.models.convert import MARKER, is_converted, stored_dtype


def test_a_missing_directory_is_not_converted(tmp_path: Path) -> None:
    assert not is_converted(tmp_path / "absent", "a" * 64)


def test_a_directory_without_marker_is_not_converted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not is_converted(tmp_path, "a" * 64)


def test_the_marker_must_name_the_same_source(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"source": "x.gguf", "source_sha256": "a" * 64}))
    assert is_converted(tmp_path, "a" * 64)
    assert not is_converted(tmp_path, "b" * 64)


def test_a_malformed_marker_is_not_converted(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("{not json")
    assert not is_converted(tmp_path, "a" * 64)
    (tmp_path / MARKER).write_text("[1, 2]")
    assert not is_converted(tmp_path, "a" * 64)


def test_the_marker_must_name_the_stored_dtype(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"source_sha256": "a" * 64}))  # before markers named it: float32
    assert is_converted(tmp_path, "a" * 64, torch.float32)
    assert not is_converted(tmp_path, "a" * 64, torch.bfloat16)
    (tmp_path / MARKER).write_text(json.dumps({"source_sha256": "a" * 64, "dtype": "bfloat16"}))
    assert is_converted(tmp_path, "a" * 64, torch.bfloat16)
    assert not is_converted(tmp_path, "a" * 64, torch.float32)


def test_bfloat16_is_stored_as_it_is_and_every_other_dtype_as_float32() -> None:
    assert stored_dtype(torch.bfloat16) == torch.bfloat16
    assert stored_dtype(torch.float16) == stored_dtype(torch.float32) == torch.float32
