"""What a finished run folder says: metrics.json, reliability.png, the metrics table, paired comparisons.

Everything here reads a run folder's run.json and predictions.csv; nothing loads a model.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slotread.errors import EvalError
from slotread.eval.metrics import ECE_BINS, expected_calibration_error, mcnemar_exact, reliability_bins, summarise
from slotread.eval.predictions import Predictions, read_predictions

RUN_INFO = "run.json"
PREDICTIONS = "predictions.csv"
METRICS = "metrics.json"
RELIABILITY = "reliability.png"
#: characters of a title line that fit the reliability diagram's width
TITLE_WIDTH = 44

#: Table columns: metrics.json key -> heading, in print order; a column shows when any run has it.
COLUMNS = {
    "system": "system",
    "dataset": "dataset",
    "split": "split",
    "items": "items",
    "accuracy": "accuracy",
    "macro_f1": "macro-F1",
    "ece": "ECE",
    "brier": "Brier",
    "nll": "NLL",
    "qwk": "QWK",
    "within_one": "within 1",
    "oos_precision": "OOS P",
    "oos_recall": "OOS R",
    "latency_p50_ms": "p50 ms",
    "latency_p95_ms": "p95 ms",
    "reads_per_item": "reads",
    "coverage": "coverage",
    "mean_set_size": "set size",
}


def load_run(out: Path) -> tuple[dict[str, Any], Predictions]:
    """A run folder's run.json and predictions."""
    try:
        info = json.loads((out / RUN_INFO).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        raise EvalError(f"{out} is not a run folder (no {RUN_INFO})") from None
    return info, read_predictions(out / PREDICTIONS)


def system_label(info: dict[str, Any]) -> str:
    """How tables and comparisons name a run's system: a run answered by learned readouts
    (``x_readout``) is ``<model> readout``, apart from the model's plain reads."""
    readout = (info.get("request") or {}).get("x_readout") is True
    return f"{info['system']} readout" if readout else str(info["system"])


def read_metrics(out: Path) -> dict[str, Any]:
    """A finished run's metrics.json."""
    try:
        metrics: dict[str, Any] = json.loads((out / METRICS).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        raise EvalError(f"{out} has no {METRICS} (is it a finished run folder?)") from None
    return metrics


def write_report(out: Path) -> dict[str, Any]:
    """Compute the run's metrics from its predictions; write metrics.json and reliability.png.

    Returns what metrics.json holds: the run's identity, the item count and every metric (null where
    undefined).
    """
    info, predictions = load_run(out)
    task = info["task"]
    positive = predictions.classes.index(task["positive"]) if task["positive"] is not None else None
    metrics = summarise(
        predictions.probabilities,
        predictions.gold,
        ordinal=task["kind"] == "score",
        positive=positive,
        latency_ms=predictions.latency_ms,
        reads=predictions.reads,
        sets=predictions.sets,
    )
    body: dict[str, Any] = {"system": system_label(info), "dataset": info["dataset"], "split": info["split"]}
    body["items"] = len(predictions.ids)
    body |= {key: None if math.isnan(value) else value for key, value in metrics.items()}
    (out / METRICS).write_text(json.dumps(body, ensure_ascii=False, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    dataset = Path(info["dataset"]).name if info["split"] is None else f"{info['dataset']} {info['split']}"
    plot_reliability(predictions, out / RELIABILITY, f"{body['system']}\n{dataset}")
    return body


def plot_reliability(predictions: Predictions, path: Path, title: str) -> None:
    """Accuracy against top-label confidence in the ECE's bins, with the item count per bin below."""
    # A bare Figure renders PNG through Agg without pyplot's global state (no display needed).
    from matplotlib.figure import Figure

    title = "\n".join(textwrap.fill(line, TITLE_WIDTH) for line in title.splitlines())  # fits the figure
    grouped = reliability_bins(predictions.probabilities, predictions.gold, ECE_BINS)
    centres = (grouped.edges[:-1] + grouped.edges[1:]) / 2
    width = 1 / ECE_BINS
    figure = Figure(figsize=(5, 6), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    filled = grouped.counts > 0
    top.bar(centres[filled], grouped.accuracy[filled], width=width, edgecolor="black", label="accuracy")
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    top.plot(grouped.confidence[filled], grouped.accuracy[filled], "o", color="black", label="bin mean confidence")
    ece = expected_calibration_error(predictions.probabilities, predictions.gold)
    top.set(ylim=(0, 1), ylabel="accuracy", title=f"{title}\nECE {ece:.3f} ({ECE_BINS} bins)")
    top.legend(loc="upper left")
    bottom.bar(centres, grouped.counts, width=width, edgecolor="black")
    bottom.set(xlim=(0, 1), xlabel="confidence (top probability)", ylabel="items")
    figure.savefig(path, dpi=100)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return (
            f"{value:.0f}"
            if key.startswith("latency")
            else f"{value:.2f}"
            if key in ("reads_per_item", "mean_set_size")
            else f"{value:.3f}"
        )
    return str(value)


def format_table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table of runs' metrics.json, one row per run."""
    keys = [key for key in COLUMNS if any(key in run for run in runs)]
    lines = ["| " + " | ".join(COLUMNS[key] for key in keys) + " |"]
    lines.append("|" + "|".join("---" if key in ("system", "dataset", "split") else "---:" for key in keys) + "|")
    lines += ["| " + " | ".join(_cell(key, run.get(key)) for key in keys) + " |" for run in runs]
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """Two runs on the items they share: accuracies, the discordant pairs behind McNemar's test, and
    ``flips``, the items whose predicted class differs (of a run and its --shuffle-options twin: the
    option-order flips)."""

    system_a: str
    system_b: str
    items: int
    accuracy_a: float
    accuracy_b: float
    a_only: int  # items only A answered right
    b_only: int  # items only B answered right
    p_value: float  # exact two-sided McNemar
    flips: int

    @property
    def flip_rate(self) -> float:
        """Share of the paired items whose predicted class differs between the runs."""
        return self.flips / self.items


def compare(run_a: Path, run_b: Path) -> Comparison:
    """Pair two runs of the same data by item id and test their accuracies.

    Runs of a built-in set must be on the same split. Runs of labelled files may be on two files (a
    file and a subset of it): their items pair by id (the file's ``id`` field, else the row number),
    and they must have the same classes and agree on every paired item's gold label.
    """
    info_a, a = load_run(run_a)
    info_b, b = load_run(run_b)
    if info_a["split"] is None and info_b["split"] is None:  # labelled files
        if info_a["task"]["classes"] != info_b["task"]["classes"]:
            raise EvalError("the runs are on different data (their questions have different classes)")
    else:
        for key in ("dataset", "split"):
            if info_a[key] != info_b[key]:
                raise EvalError(f"the runs are on different data ({key}: {info_a[key]!r} vs {info_b[key]!r})")
    row_b = {item_id: index for index, item_id in enumerate(b.ids)}
    pairs = [(index, row_b[item_id]) for index, item_id in enumerate(a.ids) if item_id in row_b]
    if not pairs:
        raise EvalError(f"{run_a} and {run_b} share no items")
    rows_a, rows_b = (np.array(rows) for rows in zip(*pairs, strict=True))
    gold = np.array(a.classes)[a.gold[rows_a]]
    if (gold != np.array(b.classes)[b.gold[rows_b]]).any():
        raise EvalError("the runs disagree on some item's gold label: they read different data")
    predicted_a, predicted_b = a.probabilities[rows_a].argmax(axis=1), b.probabilities[rows_b].argmax(axis=1)
    right_a, right_b = predicted_a == a.gold[rows_a], predicted_b == b.gold[rows_b]
    flips = int(np.sum(np.array(a.classes)[predicted_a] != np.array(b.classes)[predicted_b]))
    a_only, b_only = int(np.sum(right_a & ~right_b)), int(np.sum(right_b & ~right_a))
    return Comparison(
        system_label(info_a),
        system_label(info_b),
        len(pairs),
        float(right_a.mean()),
        float(right_b.mean()),
        a_only,
        b_only,
        mcnemar_exact(a_only, b_only),
        flips,
    )


def format_comparison(comparison: Comparison) -> str:
    """The comparison as a few lines of text."""
    c = comparison
    return "\n".join(
        [
            f"paired items: {c.items}",
            f"A {c.system_a}: accuracy {c.accuracy_a:.3f}",
            f"B {c.system_b}: accuracy {c.accuracy_b:.3f}",
            f"difference (A - B): {c.accuracy_a - c.accuracy_b:+.3f}",
            f"only A right: {c.a_only}, only B right: {c.b_only}",
            f"exact McNemar p = {c.p_value:.4g}",
            f"predicted class differs (flip rate): {c.flip_rate:.3f} ({c.flips} of {c.items})",
        ]
    )
