"""The data an evaluation may learn from: never the items it evaluates.

Baselines train on it, example banks and readout partners are built from it. A built-in set's
training data is its fitting split (``datasets.fitting_split``); a labelled file has none unless the
caller names one with ``--train``. Evaluating the fitting split itself, or a file against itself, is
refused: a baseline trained on its test items grades itself (TF-IDF + LR reports 100%), and a bank
built from the rest of a ``--limit`` sample shows the model its own test file. Texts the evaluated items
also hold are left out by each user (``banks.bank_from_dataset``, ``baseline.evaluate_baseline``).
``per_class`` keeps at most K items of each class (seeded, before the drop), so a
few-label evaluation sees nothing outside those K per class.

The one overlap check lives here too: training data (``slotread calibrate`` and ``slotread fit``'s
``--dataset``, an ``eval --example-bank`` file) that shares a text with the evaluated items is
refused (``refuse_overlap``) or has those items dropped (``drop_overlap``), texts compared
``normalised`` (whitespace collapsed, case folded). ``calibration_data`` and ``readout_data`` draw what
those two commands fit on from their settings, refusing overlap before a model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from slotread.errors import EvalError, InvalidRequest
from slotread.eval.datasets import (
    BUILTIN,
    Dataset,
    balance,
    fitting_split,
    load_dataset,
    normalised,
    per_class_sample,
    subset,
)
from slotread.quality.examples.bank import ExampleBank
from slotread.settings import CalibrateSettings, FitSettings, FittingSettings


def training_data(
    evaluated: Dataset,
    train: str | None,
    *,
    data_dir: Path | None = None,
    question: Path | None = None,
    per_class: int | None = None,
    seed: int = 0,
    purpose: str = "this evaluation",
) -> Dataset:
    """The data ``purpose`` learns from when ``evaluated`` is evaluated (module docstring).

    ``train`` is the --train file (None: a built-in set's fitting split). Raises EvalError naming
    --train when there is none, when it is the evaluated data, or when nothing is left of it.
    """
    if train is None and evaluated.name not in BUILTIN:
        raise EvalError(
            f"{purpose} learns from labelled examples, and {evaluated.name} is the file being evaluated: "
            "name a separate training file with --train FILE (nothing evaluated is ever trained on)"
        )
    name = evaluated.name if train is None else train
    split = fitting_split(name) if name in BUILTIN else None
    same = name == evaluated.name if name in BUILTIN else Path(name).resolve() == Path(evaluated.name).resolve()
    if same and split == evaluated.split:
        raise EvalError(
            f"{purpose} would learn from {evaluated.title}, the data being evaluated: evaluate another split "
            "(--split) or name a separate training file with --train FILE (nothing evaluated is ever trained on)"
        )
    data = load_dataset(name, split, data_dir=data_dir, question=question)
    if data.task.classes != evaluated.task.classes:
        raise EvalError(f"the training data ({data.title}) has other classes than the evaluated data")
    if per_class is not None:
        data = few_labels(data, per_class, seed)
    if not data.items:
        raise EvalError(f"{purpose}: the training data {data.title} holds no items")
    return data


def few_labels(data: Dataset, per_class: int, seed: int) -> Dataset:
    """At most ``per_class`` items of each class (``datasets.per_class_sample`` with ``seed``), the split's
    name saying so (bank sources, run.json, readout artifacts): what ``eval --per-class`` learns from and
    ``fit --seen-per-class`` sees, the same items for the same data and seed."""
    return replace(
        per_class_sample(data, per_class, seed), split=f"{data.split or 'file'}, {per_class} per class (seed {seed})"
    )


def refuse_overlap(data: Dataset | ExampleBank, evaluated: Dataset, flag: str = "--dataset") -> None:
    """Raise InvalidRequest if a text of ``data`` (training items, or a bank's examples) is also an item of
    ``evaluated``; the message names ``flag``, the command-line option that supplied ``data``."""
    if isinstance(data, ExampleBank):
        title, texts = data.source, [example.state for example in data.examples]
    else:
        title, texts = data.title, [item.state for item in data.items]
    held_out = {normalised(item.state) for item in evaluated.items}
    overlap = [text for text in texts if normalised(text) in held_out]
    if overlap:
        msg = (
            f"{len(overlap)} of {len(texts)} items of {title} also appear in {evaluated.title} "
            f"(texts compared with whitespace collapsed and case folded), e.g. {overlap[0]!r}; "
            f"{flag} must name data that the evaluation does not use"
        )
        if not isinstance(data, ExampleBank):
            msg += " (or pass --drop-overlap to leave those items out)"
        raise InvalidRequest.at(["data"], msg, "overlap")


def drop_overlap(data: Dataset, evaluated: Dataset) -> tuple[Dataset, int]:
    """``data`` without the items whose text an ``evaluated`` item also holds, and how many those were."""
    held_out = {normalised(item.state) for item in evaluated.items}
    kept = tuple(item for item in data.items if normalised(item.state) not in held_out)
    return replace(data, items=kept), len(data.items) - len(kept)


@dataclass(frozen=True)
class FittingData:
    """What ``slotread calibrate`` or ``slotread fit`` fits on, and the evaluation data it must not hold."""

    data: Dataset
    #: the ``--exclude`` data, if named
    exclude: Dataset | None
    #: items left out of ``data`` because ``exclude`` holds their text (calibrate's ``--drop-overlap``)
    dropped: int | None = None


def calibration_data(settings: CalibrateSettings) -> FittingData:
    """The items ``slotread calibrate`` fits on: the data without the excluded texts (with ``drop_overlap``),
    then a balanced or plain sample. Raises InvalidRequest if they overlap the excluded data, EvalError if a
    class has no items to balance."""
    data = load_dataset(settings.dataset, settings.split, data_dir=settings.data_dir, question=settings.question)
    exclude = _excluded(settings)
    dropped = None
    if exclude is not None and settings.drop_overlap:
        data, dropped = drop_overlap(data, exclude)
    data = (balance if settings.balance else subset)(data, settings.limit, settings.sample_seed)
    if exclude is not None:
        refuse_overlap(data, exclude)
    return FittingData(data, exclude, dropped)


def readout_data(settings: FitSettings) -> FittingData:
    """The items ``slotread fit`` fits on: a sample of the fitting split (or file), at most ``seen_per_class``
    of each class. Raises InvalidRequest if they overlap the excluded data, unless ``drop_overlap`` (then
    ``fit_readout`` drops those items)."""
    split = settings.split or (fitting_split(settings.dataset) if settings.dataset in BUILTIN else None)
    data = load_dataset(settings.dataset, split, data_dir=settings.data_dir, question=settings.question)
    data = subset(data, settings.limit, settings.sample_seed)
    if settings.seen_per_class:
        data = few_labels(data, settings.seen_per_class, settings.sample_seed)
    exclude = _excluded(settings)
    if exclude is not None and not settings.drop_overlap:
        refuse_overlap(data, exclude)
    return FittingData(data, exclude)


def _excluded(settings: FittingSettings) -> Dataset | None:
    """The evaluation data a fit must not hold (``--exclude``), if named."""
    if settings.exclude is None:
        return None
    return load_dataset(
        settings.exclude, settings.exclude_split, data_dir=settings.data_dir, question=settings.question
    )
