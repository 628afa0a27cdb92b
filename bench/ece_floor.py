"""How large an ECE a perfectly calibrated predictor would show on a run's items: the noise floor.

    PYTHONPATH=. python bench/ece_floor.py RUN [RUN ...] [--draws 2000]

ECE over 15 top-label confidence bins is itself an estimate: on a few hundred items a predictor
whose confidences are exactly right still shows a gap in every bin. For each run this keeps the
run's confidences, draws each item's correctness from them (so the predictor is calibrated by
construction), and prints the ECE those draws show (median and 90th percentile) beside the run's
own ECE, and the share of draws at or above it (small: the run is detectably miscalibrated).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from slotread.eval.metrics import expected_calibration_error
from slotread.eval.report import load_run


def floor(probabilities: np.ndarray, draws: int, seed: int = 0) -> np.ndarray:
    """ECE of ``draws`` calibrated outcomes: the top label right with probability its confidence."""
    generator = np.random.default_rng(seed)
    top = probabilities.argmax(axis=1)
    other = (top + 1) % probabilities.shape[1]  # any other class: a wrong answer
    confidence = probabilities.max(axis=1)
    return np.array(
        [
            expected_calibration_error(probabilities, np.where(generator.random(len(top)) < confidence, top, other))
            for _ in range(draws)
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args()
    print("| run | items | ECE | calibrated ECE median | 90th pct | share of draws >= ECE |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in args.runs:
        _, predictions = load_run(run)
        observed = expected_calibration_error(predictions.probabilities, predictions.gold)
        simulated = floor(predictions.probabilities, args.draws)
        print(
            f"| {run} | {len(predictions.gold)} | {observed:.3f} | {np.median(simulated):.3f} |"
            f" {np.quantile(simulated, 0.9):.3f} | {np.mean(simulated >= observed):.3f} |"
        )


if __name__ == "__main__":
    main()
