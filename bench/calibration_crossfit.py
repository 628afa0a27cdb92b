"""Measure calibration fitted on labels without a GPU: cross-fitted on an eval run's own predictions.

    python bench/calibration_crossfit.py runs/b77/contextual runs/b77/plain [--folds 2] [--seed 0] [--repeats 1]

Each RUN is a ``slotread eval`` output folder; its predictions.csv holds every item's answer as served
(for a ``contextual`` run: after contextual calibration and the mean over the reads, exactly what
``x_calibration: binned`` bins). The items are split into seeded folds; each fold's answers are
recalibrated by what was fitted on the other folds, with the library's own functions:

- temperature: ``fit_temperature`` on log p (for a run of one read per item, on top of what was
  served; on a plain run that is temperature scaling of the raw logits, since log p = z − logsumexp z),
- binned: ``fit_top_label_bins`` and ``apply_top_label_bins``.

It prints a Markdown table: the run, items, accuracy, and the ECE (15 bins, as ``slotread eval``
reports it) as served, after cross-fitted temperature and after cross-fitted binning. Binning keeps
every argmax, so its accuracy is the served one (checked). With ``--repeats k`` the folds are drawn
with seeds seed … seed + k − 1 and each cross-fitted ECE is their mean, with the range in brackets
(on a few hundred items one split is noisy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from slotread.eval.metrics import accuracy, expected_calibration_error
from slotread.eval.predictions import read_predictions
from slotread.quality.calibration.methods import (
    apply_top_label_bins,
    fit_temperature,
    fit_top_label_bins,
    temperature_scale,
)


def cross_fit(probabilities: np.ndarray, gold: np.ndarray, folds: int, seed: int) -> dict[str, np.ndarray]:
    """Each item's answer recalibrated by temperature and by binning fitted on the other folds."""
    fold = np.random.default_rng(seed).permutation(len(gold)) % folds
    logits = np.log(np.maximum(probabilities, np.finfo(np.float64).tiny))
    scaled, binned = np.empty_like(probabilities), np.empty_like(probabilities)
    for k in range(folds):
        held, fit = fold == k, fold != k
        scaled[held] = temperature_scale(logits[held], fit_temperature(logits[fit], gold[fit]))
        binned[held] = apply_top_label_bins(probabilities[held], fit_top_label_bins(probabilities[fit], gold[fit]))
    return {"temperature": scaled, "binned": binned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="slotread eval output folders")
    parser.add_argument("--folds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="fold draws to average over")
    args = parser.parse_args()
    seeds = range(args.seed, args.seed + args.repeats)
    print(f"Cross-fitted on each run's own items ({args.folds} folds, seeds {list(seeds)}); ECE with 15 bins.\n")
    print("| run | items | accuracy | ECE as served | ECE + temperature | ECE + binned |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in args.runs:
        found = read_predictions(run / "predictions.csv")
        p, gold = found.probabilities, found.gold
        eces: dict[str, list[float]] = {"temperature": [], "binned": []}
        for seed in seeds:
            fitted = cross_fit(p, gold, args.folds, seed)
            assert (fitted["binned"].argmax(axis=1) == p.argmax(axis=1)).all(), "binning moved an argmax"
            for method, recalibrated in fitted.items():
                eces[method].append(expected_calibration_error(recalibrated, gold))
        cells = " | ".join(_spread(values) for values in eces.values())
        served = expected_calibration_error(p, gold)
        name = "/".join(run.parts[-2:])
        print(f"| {name} | {len(gold)} | {accuracy(p.argmax(axis=1), gold):.3f} | {served:.3f} | {cells} |")


def _spread(values: list[float]) -> str:
    mean = f"{np.mean(values):.3f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.3f}–{max(values):.3f})"


if __name__ == "__main__":
    main()
