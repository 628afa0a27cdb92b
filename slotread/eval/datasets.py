"""Labelled data as evaluation items: each row becomes (id, state, gold class), asked one question.

Built-in sets are folders of the data directory (each with its PROVENANCE.md and licence); the package
ships them xz-compressed in ``slotread/eval/data`` (see its README.md), and a data directory given with
--data-dir or $SLOTREAD_DATA may hold the same files plain or compressed:

    banking77  test (default), train, subset154     one 77-option choice over the customer message
    clinc150   test (default), val, train, test_2per_label
                                                    one 151-option choice, out-of-scope included
    sst5       test (default), val, train           a 5-level score of the review
    boolq      dev (default), dev_500, dev_rest     a noul over the passage and its question
                                                    (dev_rest: dev without dev_500, to fit on)

Any other labelled file works with a question file: a ``.jsonl`` of objects or a ``.csv`` with a
``text`` and a ``label`` field, or ``state`` and ``answer`` as an example bank's lines name them
(``id`` optional, else the row number), and a JSON file holding the System One question object to
ask of every text. A noul label is yes/no (or true/false, 1/0), a
choice label an option name, a score label a level index or the level's text.

This module reads files; it knows nothing of models.
"""

from __future__ import annotations

import csv
import io
import json
import lzma
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from slotread.errors import EvalError

Kind = Literal["noul", "choice", "score"]

#: The data directory when neither --data-dir nor $SLOTREAD_DATA names one: the copy shipped in the package.
PACKAGED_DATA_DIR = Path(__file__).with_name("data")

# Question wording. The causal layout puts the state first and this text after it, followed by the
# options and "Answer with the label of the best option." (prompt/render.py). BoolQ and SST-5 keep
# the wording the earlier smoke test measured with qwen2.5-coder-1.5b-instruct on 80 items (README,
# Benchmarks): BoolQ 65%, SST-5 28.7% exact and 63.7% within one level. Choice options are named by
# their category made readable, with no description: the prompt shows an option's name and its
# description, so a description repeating the name would double the 77- and 151-line option lists.
BANKING77_QUESTION = "Which of these topics is this bank customer's message about?"
CLINC150_QUESTION = "Which of these intents does this message to a virtual assistant express?"
CLINC150_OUT_OF_SCOPE = ("out of scope", "the message fits none of the other intents")
SST5_QUESTION = "How positive is this movie review?"
SST5_LEVELS = ("very negative", "negative", "neutral", "positive", "very positive")
# BoolQ's question goes into the state beside its passage, so every item asks one question (one
# schema): calibration artifacts and content-free reads are per schema.
BOOLQ_QUESTION = "Going by the passage, is the answer to the question yes?"
BOOLQ_STATE = "{passage}\n\nQuestion: {question}?"

#: Words respelled when a category name is made readable; the rest are lower-cased.
SPELLING = {
    "ai": "AI",
    "apr": "APR",
    "apple": "Apple",
    "atm": "ATM",
    "google": "Google",
    "mastercard": "Mastercard",
    "mpg": "MPG",
    "pin": "PIN",
    "pto": "PTO",
    "uber": "Uber",
    "visa": "Visa",
    "w2": "W-2",
    "401k": "401(k)",
}


@dataclass(frozen=True)
class Task:
    """What every item of a dataset is asked.

    ``question`` is the System One question object; ``classes`` the gold labels as the data writes
    them, in option order (``yes``, ``no`` for a noul; ``"0"``.. for score levels); ``positive`` the
    class whose precision and recall are reported on their own (CLINC150's out-of-scope).
    """

    kind: Kind
    question: dict[str, Any]
    classes: tuple[str, ...]
    positive: str | None = None


@dataclass(frozen=True)
class Item:
    """One labelled state: ``gold`` indexes ``Task.classes``."""

    id: str
    state: str
    gold: int


@dataclass(frozen=True)
class Dataset:
    """A split of a dataset: its name (a built-in name or a file path), the task and the items.

    ``sample`` is (limit, seed) when the items are a seeded sample of the split (see ``subset``);
    ``balanced`` is true when they hold the same number of items of every class (see ``balance``).
    """

    name: str
    split: str | None
    task: Task
    items: tuple[Item, ...]
    sample: tuple[int, int] | None = None
    balanced: bool = False

    @property
    def title(self) -> str:
        """The name and split as one name: ``banking77 train``."""
        return self.name + (f" {self.split}" if self.split else "")


def readable(category: str) -> str:
    """A category name as words: ``card_payment_fee_charged`` -> ``card payment fee charged``."""
    words = category.rstrip("?").split("_")
    return " ".join(SPELLING.get(word.lower(), word.lower()) for word in words)


def resolve_data_dir(explicit: Path | None) -> Path:
    """``explicit`` (--data-dir), else $SLOTREAD_DATA, else the data shipped in the package."""
    if explicit is not None:
        return explicit
    return Path(os.environ.get("SLOTREAD_DATA") or PACKAGED_DATA_DIR)


def _open_data(path: Path) -> io.TextIOBase:
    """A data file as text: ``path`` itself, else its xz-compressed copy ``path.xz``.

    Raises FileNotFoundError naming ``path`` when neither exists.
    """
    if path.is_file():
        return path.open(encoding="utf-8", newline="")
    compressed = path.with_name(path.name + ".xz")
    if compressed.is_file():
        return io.TextIOWrapper(lzma.open(compressed), encoding="utf-8", newline="")
    raise FileNotFoundError(2, "no such file", str(path))


def _choice_task(names: list[str], question: str, descriptions: dict[str, str] | None = None) -> dict[str, Any]:
    descriptions = descriptions or {}
    criteria = {readable(name): descriptions.get(name) for name in names}
    if len(criteria) != len(names):
        raise EvalError(f"two categories read the same once made readable: {names}")
    return {"type": "choice", "instructions": question, "criteria": criteria}


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """Rows with their line numbers (the header is line 1)."""
    with _open_data(path) as handle:
        reader = csv.DictReader(handle)
        for row in reader:
            yield reader.line_num, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_data(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalError(f"{path}:{line_number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise EvalError(f"{path}:{line_number}: expected a JSON object")
            yield line_number, row


def _field(path: Path, line: int, row: dict[str, Any], name: str) -> Any:
    if row.get(name) is None:
        raise EvalError(f"{path}:{line}: no {name!r} field")
    return row[name]


def _gold(path: Path, line: int, label: str, classes: tuple[str, ...]) -> int:
    if label not in classes:
        raise EvalError(f"{path}:{line}: label {label!r} is not one of the {len(classes)} classes")
    return classes.index(label)


def _csv_items(path: Path, label: str, classes: tuple[str, ...], id_field: str | None = None) -> list[Item]:
    """Items from a CSV with a ``text`` column and a label column; ids are row numbers or ``id_field``."""
    items = []
    for index, (line, row) in enumerate(_csv_rows(path)):
        item_id = _field(path, line, row, id_field) if id_field else str(index)
        gold = _gold(path, line, _field(path, line, row, label), classes)
        items.append(Item(item_id, _field(path, line, row, "text"), gold))
    return items


def _banking77(folder: Path, split: str) -> tuple[Task, list[Item]]:
    categories = json.loads((folder / "categories.json").read_text(encoding="utf-8"))
    task = Task("choice", _choice_task(categories, BANKING77_QUESTION), tuple(categories))
    # subset154.csv names each row by its row in test.csv, so its items pair with a test run's
    id_field = "test_index" if split == "subset154" else None
    return task, _csv_items(folder / f"{split}.csv", "category", task.classes, id_field)


def _clinc150(folder: Path, split: str) -> tuple[Task, list[Item]]:
    domains = json.loads((folder / "domains.json").read_text(encoding="utf-8"))
    intents = [intent for members in domains.values() for intent in members]  # grouped by domain
    name, description = CLINC150_OUT_OF_SCOPE
    question = _choice_task(intents, CLINC150_QUESTION)
    question["criteria"][name] = description
    task = Task("choice", question, (*intents, "oos"), positive="oos")
    return task, _csv_items(folder / f"{split}.csv", "label", task.classes)


def _sst5(folder: Path, split: str) -> tuple[Task, list[Item]]:
    question = {"type": "score", "instructions": SST5_QUESTION, "criteria": list(SST5_LEVELS)}
    task = Task("score", question, tuple(str(i) for i in range(len(SST5_LEVELS))))
    return task, _csv_items(folder / f"{split}.csv", "label", task.classes)


def _boolq(folder: Path, split: str) -> tuple[Task, list[Item]]:
    task = Task("noul", {"type": "noul", "instructions": BOOLQ_QUESTION}, ("yes", "no"))
    held_out: set[str] = set()
    if split == "dev_rest":
        split, held_out = "dev", {item.id for item in _boolq_items(folder / "dev_500.jsonl", task)}
    return task, [item for item in _boolq_items(folder / f"{split}.jsonl", task) if item.id not in held_out]


def _boolq_items(path: Path, task: Task) -> list[Item]:
    items = []
    for line, row in _jsonl_rows(path):
        fields = {name: _field(path, line, row, name) for name in ("idx", "passage", "question", "label")}
        state = BOOLQ_STATE.format(passage=fields["passage"], question=fields["question"])
        items.append(Item(str(fields["idx"]), state, _gold(path, line, fields["label"], task.classes)))
    return items


Loader = Callable[[Path, str], tuple[Task, list[Item]]]

#: Built-in sets: loader and splits, the evaluation split first (the default).
BUILTIN: dict[str, tuple[Loader, tuple[str, ...]]] = {
    "banking77": (_banking77, ("test", "train", "subset154")),
    "clinc150": (_clinc150, ("test", "val", "train", "test_2per_label")),
    "sst5": (_sst5, ("test", "val", "train")),
    "boolq": (_boolq, ("dev", "dev_500", "dev_rest")),
}


def fitting_split(name: str) -> str:
    """The split a built-in set trains or fits on (baselines): ``train``, or BoolQ's ``dev_rest``."""
    return "dev_rest" if name == "boolq" else "train"


def read_question(path: Path) -> dict[str, Any]:
    """A question file: one System One question object (``type``, ``instructions``, ``criteria``)."""
    try:
        question = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EvalError(f"cannot read the question file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise EvalError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(question, dict) or question.get("type") not in ("noul", "choice", "score"):
        raise EvalError(f"{path}: expected a System One question object with type noul, choice or score")
    return question


def _file_task(question: dict[str, Any], source: Path) -> Task:
    kind = question["type"]
    criteria = question.get("criteria")
    if kind == "noul":
        return Task("noul", question, ("yes", "no"))
    if kind == "choice" and isinstance(criteria, dict):
        return Task("choice", question, tuple(criteria))
    if kind == "score" and isinstance(criteria, list):
        return Task("score", question, tuple(str(i) for i in range(len(criteria))))
    raise EvalError(f"{source}: a {kind} question needs its criteria ({'an object' if kind == 'choice' else 'a list'})")


_NOUL_LABELS = {"yes": "yes", "true": "yes", "1": "yes", "no": "no", "false": "no", "0": "no"}


def _file_label(task: Task, value: Any) -> str | None:
    """The class a labelled file's ``label`` value names, or None."""
    if task.kind == "noul":
        return _NOUL_LABELS.get(str(value).lower())
    if task.kind == "score":
        levels = task.question["criteria"]
        if isinstance(value, str) and value in levels:
            return str(levels.index(value))
        return str(value) if str(value) in task.classes else None
    return value if isinstance(value, str) and value in task.classes else None


def _labelled_file(path: Path, task: Task) -> list[Item]:
    if path.suffix == ".jsonl":
        rows: Iterator[tuple[int, dict[str, Any]]] = _jsonl_rows(path)
    elif path.suffix == ".csv":
        rows = _csv_rows(path)
    else:
        raise EvalError(f"{path}: a labelled file must end in .jsonl or .csv")
    items = []
    for index, (line, row) in enumerate(rows):
        text_field, label_field = _row_fields(path, line, row)
        text = row[text_field]
        if not isinstance(text, str):
            raise EvalError(f"{path}:{line}: {text_field!r} must be a string")
        label = _file_label(task, row[label_field])
        if label is None:
            raise EvalError(f"{path}:{line}: {label_field} {row[label_field]!r} is not an answer of the question")
        items.append(Item(str(row.get("id", index)), text, task.classes.index(label)))
    return items


def _row_fields(path: Path, line: int, row: dict[str, Any]) -> tuple[str, str]:
    """A labelled row's text and label fields: ``text`` and ``label``, or an example bank's ``state``
    and ``answer`` (they say the same)."""
    for fields in (("text", "label"), ("state", "answer")):
        if all(row.get(name) is not None for name in fields):
            return fields
    missing = [name for name in ("text", "label") if row.get(name) is None]
    raise EvalError(f"{path}:{line}: no {' or '.join(map(repr, missing))} field (nor 'state' and 'answer')")


def load_dataset(
    dataset: str, split: str | None = None, *, data_dir: Path | None = None, question: Path | None = None
) -> Dataset:
    """A built-in set's split (default: its evaluation split) or a labelled file with its question file.

    Raises EvalError naming the folder or file it looked for, or the row that is malformed.
    """
    if dataset in BUILTIN:
        loader, splits = BUILTIN[dataset]
        split = split or splits[0]
        if split not in splits:
            raise EvalError(f"{dataset} has no split {split!r}; its splits: {', '.join(splits)}")
        folder = resolve_data_dir(data_dir) / dataset
        try:
            task, items = loader(folder, split)
        except FileNotFoundError as exc:
            raise EvalError(
                f"no {dataset} data: {exc.filename} is missing, nor is it there xz-compressed (the data "
                f"directory comes from --data-dir, else $SLOTREAD_DATA, else the copy shipped in the package; "
                f"looked in {folder.resolve()})"
            ) from None
        return Dataset(dataset, split, task, tuple(items))
    path = Path(dataset)
    if not path.is_file():
        raise EvalError(f"unknown dataset {dataset!r}: name one of {', '.join(BUILTIN)} or a labelled .jsonl/.csv file")
    if question is None:
        raise EvalError(f"{dataset}: a labelled file needs a question file (--question)")
    task = _file_task(read_question(question), question)
    return Dataset(dataset, None, task, tuple(_labelled_file(path, task)))


def normalised(text: str) -> str:
    """How texts are compared for overlap between data sets: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def subset(dataset: Dataset, limit: int | None, seed: int) -> Dataset:
    """``limit`` items drawn without replacement with ``random.Random(seed)``, kept in file order.

    Built-in files are sorted by class, so the first N items would all share a label.
    """
    if limit is None or limit >= len(dataset.items):
        return dataset
    picked = sorted(random.Random(seed).sample(range(len(dataset.items)), limit))
    return replace(dataset, items=tuple(dataset.items[i] for i in picked), sample=(limit, seed))


def per_class_sample(data: Dataset, per_class: int | None, seed: int) -> Dataset:
    """At most ``per_class`` items of each class, drawn with ``random.Random(seed)``, kept in file order."""
    if per_class is None:
        return data
    by_class: dict[int, list[int]] = {}
    for index, item in enumerate(data.items):
        by_class.setdefault(item.gold, []).append(index)
    rng = random.Random(seed)
    kept = sorted(i for members in by_class.values() for i in rng.sample(members, min(per_class, len(members))))
    return replace(data, items=tuple(data.items[i] for i in kept))


def class_counts(dataset: Dataset) -> dict[str, int]:
    """How many items each class has, every class of the task named (in class order), empty ones as 0."""
    counts = dict.fromkeys(dataset.task.classes, 0)
    for item in dataset.items:
        counts[dataset.task.classes[item.gold]] += 1
    return counts


def balance(dataset: Dataset, limit: int | None, seed: int) -> Dataset:
    """The same number of items of every class, drawn by ``per_class_sample`` with ``seed``, kept in file order.

    Each class keeps as many items as the smallest class has, or ``limit // classes`` when ``limit`` is
    given and that is fewer, so at most ``limit`` items. The result is marked ``balanced``, and as a
    ``sample`` (its size and seed: ``balance`` with that size and seed draws it again) when items are left out.
    Raises EvalError when a class has no items or ``limit`` is below the number of classes.
    """
    counts = class_counts(dataset)
    if empty := [name for name, count in counts.items() if count == 0]:
        shown = ", ".join(map(repr, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise EvalError(
            f"{dataset.title} has no items of class {shown} (of {len(counts)} classes): "
            "a balanced sample needs items of every class"
        )
    per_class = min(counts.values())
    if limit is not None:
        if limit < len(counts):
            raise EvalError(f"a balanced sample of {len(counts)} classes needs a limit of at least {len(counts)}")
        per_class = min(per_class, limit // len(counts))
    drawn = per_class_sample(dataset, per_class, seed)
    sample = (len(drawn.items), seed) if len(drawn.items) < len(dataset.items) else dataset.sample
    return replace(drawn, sample=sample, balanced=True)
