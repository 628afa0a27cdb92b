"""Split-conformal thresholds and sets, by hand and by simulation."""

import math

import numpy as np
import pytest

from slotread.quality.calibration.conformal import conformal_threshold, nonconformity, prediction_set

SCORES = np.array([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6])  # 0.1 .. 0.9, shuffled


def test_nonconformity_is_one_minus_the_gold_probability() -> None:
    p = np.array([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]])
    assert nonconformity(p, np.array([0, 2])) == pytest.approx([0.3, 0.75])


@pytest.mark.parametrize(
    ("coverage", "expected"),
    [
        (0.9, 0.9),  # ⌈10 · 0.9⌉ = 9: the 9th smallest of 9
        (0.7, 0.7),  # ⌈10 · 0.7⌉ = 7 (10 · 0.7 is 7.000000000000001 in floats)
        (0.5, 0.5),  # ⌈5⌉ = 5
        (0.51, 0.6),  # ⌈5.1⌉ = 6
        (0.05, 0.1),  # ⌈0.5⌉ = 1: the smallest
    ],
)
def test_the_threshold_is_the_finite_sample_quantile(coverage: float, expected: float) -> None:
    assert conformal_threshold(SCORES, coverage) == pytest.approx(expected)


def test_too_few_scores_for_the_coverage_give_every_option() -> None:
    # n = 3 and coverage 0.9: ⌈4 · 0.9⌉ = 4 > 3
    threshold = conformal_threshold(np.array([0.1, 0.2, 0.3]), 0.9)
    assert threshold == math.inf
    assert prediction_set(np.array([0.98, 0.01, 0.01]), threshold) == (0, 1, 2)


def test_the_set_holds_the_options_within_the_threshold_in_option_order() -> None:
    p = np.array([0.1, 0.6, 0.05, 0.25])
    assert prediction_set(p, 0.75) == (1, 3)  # 1 − p = [0.9, 0.4, 0.95, 0.75]
    assert prediction_set(p, 0.3) == ()  # a set may be empty
    assert prediction_set(p, 0.9) == (0, 1, 3)


def test_sets_cover_the_target_share_of_new_items() -> None:
    # A calibrated model: gold drawn from its own distribution; calibration and test items exchangeable.
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(5, 0.5), size=6000)
    gold = np.array([rng.choice(5, p=row) for row in p])
    threshold = conformal_threshold(nonconformity(p[:1000], gold[:1000]), 0.9)
    covered = [g in prediction_set(row, threshold) for row, g in zip(p[1000:], gold[1000:], strict=True)]
    assert np.mean(covered) == pytest.approx(0.9, abs=0.015)
