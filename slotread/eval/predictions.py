"""predictions.csv: one row per item, appended and flushed as each item is answered.

Columns: ``id, gold, predicted, correct, latency_ms, reads, input_tokens, label_mass, entropy, stderr,
set`` and then ``p:<class>`` for every class in option order (full-precision floats). ``gold`` and
``predicted`` are class names as the data writes them; the diagnostics are empty where the predictor
has none (the baseline reads no model). ``stderr`` is the standard error of the predicted option's
probability over the draws (empty when it was read once). ``set`` is the conformal prediction set
(``x_set``, asked for with ``x_coverage``) as a JSON list of class indices, e.g. ``[0,3]`` (``[]`` an
empty set), and empty when the answer had none. Files written before the ``set`` column existed are
read as they are and get an empty ``set`` cell per row when reopened for appending.

A row is complete once its newline is written, so a run killed mid-row leaves a torn last line that
reopening drops; the rows before it are kept and their items are not read again.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

import numpy as np

from slotread.errors import EvalError

COLUMNS = (
    "id",
    "gold",
    "predicted",
    "correct",
    "latency_ms",
    "reads",
    "input_tokens",
    "label_mass",
    "entropy",
    "stderr",
    "set",
)
PROBABILITY = "p:"
#: The columns before ``set`` was added: such files stay readable and resumable.
LEGACY_COLUMNS = COLUMNS[:-1]


@dataclass(frozen=True)
class Prediction:
    """What a predictor says about one item: probabilities in class order, and the read's diagnostics."""

    probabilities: np.ndarray
    reads: int | None = None
    input_tokens: int | None = None
    label_mass: float | None = None
    entropy: float | None = None
    stderr: float | None = None
    prediction_set: tuple[int, ...] | None = None  # class indices of the conformal set (x_set)


@dataclass(frozen=True)
class Predictions:
    """A predictions.csv read back: one entry per row, in file order; ``reads`` None for the baseline.

    ``sets`` holds each row's conformal prediction set (class indices, None for a row without one),
    or is None when no row has one.
    """

    ids: tuple[str, ...]
    classes: tuple[str, ...]
    probabilities: np.ndarray  # (N, K)
    gold: np.ndarray  # (N,) class indices
    latency_ms: np.ndarray  # (N,)
    reads: np.ndarray | None  # (N,)
    sets: tuple[tuple[int, ...] | None, ...] | None = None


def _complete_rows(path: Path) -> str:
    """The file's text up to its last newline: a row cut off mid-write has none."""
    text = path.read_text(encoding="utf-8")
    return text[: text.rfind("\n") + 1]


def header(classes: tuple[str, ...]) -> list[str]:
    """The column names for a task with these classes."""
    return [*COLUMNS, *(PROBABILITY + name for name in classes)]


def _cell(value: float | int | None) -> str:
    return "" if value is None else repr(value)


def _set_cell(prediction_set: tuple[int, ...] | None) -> str:
    return "" if prediction_set is None else json.dumps(list(prediction_set), separators=(",", ":"))


def _upgrade(rows: list[list[str]]) -> str:
    """A file in the legacy layout rewritten with an empty ``set`` cell in every row."""
    at = len(LEGACY_COLUMNS)
    handle = io.StringIO(newline="")
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow([*rows[0][:at], "set", *rows[0][at:]])
    writer.writerows([*row[:at], "", *row[at:]] for row in rows[1:])
    return handle.getvalue()


class PredictionsFile:
    """predictions.csv opened for appending; ``done`` holds the ids of the complete rows already there."""

    def __init__(self, path: Path, classes: tuple[str, ...]) -> None:
        self.classes = classes
        self.done: set[str] = set()
        columns = header(classes)
        if path.exists():
            text = _complete_rows(path)
            rows = list(csv.reader(io.StringIO(text, newline="")))
            if rows and rows[0] == [*LEGACY_COLUMNS, *columns[len(COLUMNS) :]]:
                text = _upgrade(rows)
            elif rows and rows[0] != columns:
                raise EvalError(f"{path} has other columns than this run writes; use another --out")
            self.done = {row[0] for row in rows[1:]}
            path.write_text(text, encoding="utf-8")  # drop a torn last row
        self._handle: TextIO = path.open("a", encoding="utf-8", newline="")
        self._writer = csv.writer(self._handle, lineterminator="\n")
        if self._handle.tell() == 0:
            self._write(columns)

    def _write(self, row: list[str]) -> None:
        self._writer.writerow(row)
        self._handle.flush()

    def append(self, item_id: str, gold: int, prediction: Prediction, latency_ms: float) -> None:
        """Write one item's row and flush it."""
        p = prediction.probabilities
        top = int(p.argmax())
        row = [item_id, self.classes[gold], self.classes[top], str(int(top == gold)), repr(latency_ms)]
        row += [_cell(prediction.reads), _cell(prediction.input_tokens), _cell(prediction.label_mass)]
        row += [_cell(prediction.entropy), _cell(prediction.stderr), _set_cell(prediction.prediction_set)]
        row += [repr(float(v)) for v in p]
        self._write(row)
        self.done.add(item_id)

    def close(self) -> None:
        """Close the file."""
        self._handle.close()

    def __enter__(self) -> PredictionsFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def read_predictions(path: Path) -> Predictions:
    """Read a predictions.csv back (complete rows only)."""
    try:
        rows = list(csv.reader(io.StringIO(_complete_rows(path), newline="")))
    except FileNotFoundError:
        raise EvalError(f"no predictions at {path}") from None
    if len(rows) < 2:
        raise EvalError(f"{path} holds no predictions")
    column = {name: k for k, name in enumerate(rows[0])}
    classes = tuple(name[len(PROBABILITY) :] for name in rows[0] if name.startswith(PROBABILITY))
    table = np.array(rows[1:], dtype=object)
    reads = table[:, column["reads"]]
    sets = table[:, column["set"]] if "set" in column else np.full(len(table), "")
    return Predictions(
        ids=tuple(table[:, column["id"]]),
        classes=classes,
        probabilities=table[:, [k for k, name in enumerate(rows[0]) if name.startswith(PROBABILITY)]].astype(
            np.float64
        ),
        gold=np.array([classes.index(name) for name in table[:, column["gold"]]]),
        latency_ms=table[:, column["latency_ms"]].astype(np.float64),
        reads=None if (reads == "").all() else np.array([float(r) if r else np.nan for r in reads]),
        sets=None if (sets == "").all() else tuple(tuple(json.loads(cell)) if cell else None for cell in sets),
    )
