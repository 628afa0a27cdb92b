"""What every fitted artifact shares: its header, its file name and how it is written and read.

Both artifact formats (``slotread-calibration/1``, ``quality.calibration.artifact``; and
``slotread-readout/1``, ``quality.readouts.readout``) are JSON objects that start with one header

    {"format": "<name>/1", "model": "<model name>", "schema": "<schema_hash>",
     "question": {"type": "choice", "options": ["...", ...]}, ..., "fitted_on": {...}}

naming the model and the question schema the artifact was fitted for. ``Artifact`` holds those
fields; each format adds its own, writes its body after ``header`` and reads it after
``parse_header``. Files are written atomically (a server loading a directory never sees half a file),
and a directory of them is read one way (``load_directory``) by both stores.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slotread.core.questions import Question
from slotread.errors import CalibrationError

logger = logging.getLogger(__name__)


def schema_hash(question: Question, instructions: str | None) -> str:
    """sha256 of what a prompt shows of a question besides the state: its type, instructions and options
    (names and descriptions, in order), and the request-wide instructions. Ids and earlier answers are
    not part of it."""
    options = tuple((o.name, o.description) for o in question.options)
    return _schema_hash(question.kind, question.instructions, options, instructions)


@functools.lru_cache(maxsize=4096)
def _schema_hash(
    kind: str, instructions: str | None, options: tuple[tuple[str, str | None], ...], request_instructions: str | None
) -> str:
    # kept: every decision hashes its schemas, and most requests repeat them (JSON of 1,500 tokens of
    # instructions and sha256 of it cost ~0.1 ms a question)
    payload = {
        "type": kind,
        "instructions": instructions,
        "options": [list(option) for option in options],
        "request_instructions": request_instructions,
    }
    text = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class Artifact:
    """The header of an artifact fitted for one (model, schema): the question's type and option names,
    and what it was fitted on (free-form JSON, recorded as given)."""

    model: str
    schema: str
    kind: str
    options: tuple[str, ...]
    fitted_on: Mapping[str, Any] = field(default_factory=dict, kw_only=True)

    def header(self, format: str) -> dict[str, Any]:
        """The JSON fields every artifact starts with."""
        return {
            "format": format,
            "model": self.model,
            "schema": self.schema,
            "question": {"type": self.kind, "options": list(self.options)},
        }


def parse_header(data: Any, format: str) -> dict[str, Any]:
    """The ``Artifact`` fields of JSON ``data`` in ``format``; ValueError (or KeyError, TypeError) if it is
    another format or lacks them."""
    if data.get("format") != format:
        raise ValueError(f"format must be {format!r}, got {data.get('format')!r}")
    question = data["question"]
    return {
        "model": str(data["model"]),
        "schema": str(data["schema"]),
        "kind": str(question["type"]),
        "options": tuple(str(o) for o in question["options"]),
        "fitted_on": dict(data.get("fitted_on", {})),
    }


def file_stem(model: str, schema: str) -> str:
    """``<model>.<schema[:16]>``, the model name made file-safe: how an artifact's file is named."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.") or "model"
    return f"{slug}.{schema[:16]}"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as out:
        json.dump(data, out, ensure_ascii=False, indent=1)
    os.replace(out.name, path)


Loaded = TypeVar("Loaded", bound=Artifact)


def load_directory(
    directory: Path, pattern: str, load: Callable[[Path], Loaded], model: str, *, what: str, clash: str
) -> dict[str, tuple[Loaded, Path]]:
    """The artifacts of ``model`` in ``directory`` (its files matching ``pattern``, read by ``load`` in name
    order), by schema, each with its file; those of other models are skipped. ``load`` raises
    CalibrationError for a file it cannot read, and so does this when two files claim one schema:
    "<file> and <file> ``clash`` schema <schema> of <model>". ``what`` names the artifacts in the log."""
    found: dict[str, tuple[Loaded, Path]] = {}
    for path in sorted(directory.glob(pattern)):
        artifact = load(path)
        if artifact.model != model:
            logger.info("%s is fitted for %s, not %s: skipped", path, artifact.model, model)
            continue
        if artifact.schema in found:
            raise CalibrationError(
                f"{path} and {found[artifact.schema][1]} {clash} schema {artifact.schema} of {model}"
            )
        found[artifact.schema] = (artifact, path)
    logger.info("%d %s for %s from %s", len(found), what, model, directory)
    return found
