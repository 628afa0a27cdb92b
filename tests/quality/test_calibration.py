"""Calibration maths, checked on cases worked out by hand."""

import math

import numpy as np
import pytest

from slotread.quality.calibration import (
    T_MAX,
    T_MIN,
    calibrate_reads,
    divide_prior,
    fit_temperature,
    mean_nll,
    temperature_scale,
)


def test_temperature_scaling_by_hand() -> None:
    # softmax([2, 0] / 2) = softmax([1, 0]) = [e/(e+1), 1/(e+1)]
    assert temperature_scale(np.array([2.0, 0.0]), 2.0) == pytest.approx([0.7311, 0.2689], abs=1e-4)


def test_mean_nll_by_hand() -> None:
    # p = softmax([0, ln 3]) = [0.25, 0.75]: gold 1 costs -ln 0.75, gold 0 costs -ln 0.25
    logits = np.array([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    assert mean_nll(logits, np.array([1, 0])) == pytest.approx(-(math.log(0.75) + math.log(0.25)) / 2)


def test_temperature_fit_finds_the_known_optimum() -> None:
    # Four items with logits [2, 0], three of them gold 0: the NLL -3 log s(2/T) - log(1 - s(2/T)) is
    # least where s(2/T) = 3/4, i.e. 2/T = ln 3, T = 2 / ln 3 = 1.8205.
    logits = np.array([[2.0, 0.0]] * 4)
    gold = np.array([0, 0, 0, 1])
    assert fit_temperature(logits, gold) == pytest.approx(2 / math.log(3), abs=1e-5)


def test_temperature_fit_with_several_reads_per_item() -> None:
    # Two identical reads per item average to the same distribution: the same optimum.
    logits = np.array([[[2.0, 0.0]] * 2] * 4)
    assert fit_temperature(logits, np.array([0, 0, 0, 1])) == pytest.approx(2 / math.log(3), abs=1e-5)


def test_temperature_fit_stays_within_its_bounds() -> None:
    # Always right: sharper is always better, so the search ends at the lower bound; always wrong: upper.
    logits = np.array([[1.0, 0.0, 0.0]] * 3)
    assert fit_temperature(logits, np.array([0, 0, 0])) == pytest.approx(T_MIN, rel=1e-5)
    assert fit_temperature(logits, np.array([1, 2, 1])) == pytest.approx(T_MAX, rel=1e-5)


def test_dividing_by_a_prior_by_hand() -> None:
    # p = [0.5, 0.3, 0.2], prior = [0.5, 0.25, 0.25]: p / prior = [1, 1.2, 0.8], over 3 = [1/3, 0.4, 0.8/3]
    logits = np.log(np.array([0.5, 0.3, 0.2])) + 7.0  # a constant shift changes nothing
    assert divide_prior(logits, np.array([0.5, 0.25, 0.25])) == pytest.approx([1 / 3, 0.4, 0.8 / 3])


def test_a_uniform_prior_changes_nothing() -> None:
    logits = np.array([1.0, -2.0, 0.5, 3.0])
    assert divide_prior(logits, np.full(4, 0.25)) == pytest.approx(temperature_scale(logits, 1.0))


def test_contextual_reads_are_divided_by_their_own_assignment_s_prior() -> None:
    logits = np.log(np.array([[0.5, 0.5], [0.5, 0.5]]))
    content_free = {0: np.array([0.8, 0.2]), 1: np.array([0.2, 0.8])}
    # read 0 under shift 0: [0.5/0.8, 0.5/0.2] -> [0.2, 0.8]; read 1 under shift 1: [0.8, 0.2]
    got = calibrate_reads(logits, [0, 1], "contextual", content_free=content_free)
    assert got == pytest.approx(np.array([[0.2, 0.8], [0.8, 0.2]]))
    assert calibrate_reads(logits, [0, 1], "temperature", temperature=3.0) == pytest.approx(np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="temperature"):
        calibrate_reads(logits, [0, 1], "temperature")
