"""Calibration maths, checked on cases worked out by hand."""

import math

import numpy as np
import pytest

from slotread.quality.calibration.methods import (
    T_MAX,
    T_MIN,
    TopLabelBins,
    apply_top_label_bins,
    calibrate_reads,
    divide_prior,
    fit_temperature,
    fit_top_label_bins,
    mean_nll,
    pool_adjacent_violators,
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


def _two_options(confidences: list[float]) -> np.ndarray:
    return np.array([[c, 1 - c] for c in confidences])


def test_top_label_bins_by_hand() -> None:
    # 6 answers, at least 3 a bin: 2 bins split at the 3rd smallest confidence, 0.65.
    # Bin 0 {0.55, 0.6, 0.65}: 1 right, (1 + 1)/(3 + 2) = 0.4; bin 1 {0.8, 0.85, 0.9}: 3 right, 4/5 = 0.8.
    answers = _two_options([0.8, 0.55, 0.9, 0.6, 0.85, 0.65])
    fitted = fit_top_label_bins(answers, np.array([0, 0, 0, 1, 0, 1]), bins=10, min_per_bin=3)
    assert fitted.edges == pytest.approx([0.65])
    assert fitted.values == pytest.approx([0.4, 0.8])
    assert fitted.counts == pytest.approx([3, 3])


def test_top_label_bins_are_made_monotone() -> None:
    # Bin 0 is 2 of 3 right (3/5 = 0.6), bin 1 none of 3 (1/5 = 0.2): pooled (0.6·3 + 0.2·3)/6 = 0.4.
    answers = _two_options([0.55, 0.6, 0.65, 0.8, 0.85, 0.9])
    fitted = fit_top_label_bins(answers, np.array([0, 0, 1, 1, 1, 1]), bins=10, min_per_bin=3)
    assert fitted.values == pytest.approx([0.4, 0.4])


def test_few_answers_get_one_bin_and_ties_merge_edges() -> None:
    # 5 answers, 3 a bin: one bin, 2 of 5 right, 3/7.
    one = fit_top_label_bins(_two_options([0.6] * 5), np.array([0, 0, 1, 1, 1]), min_per_bin=3)
    assert one.edges.size == 0 and one.values == pytest.approx([3 / 7])
    # 6 equal confidences: the edge would equal the largest confidence, so it is dropped.
    tied = fit_top_label_bins(_two_options([0.7] * 6), np.zeros(6, dtype=int), min_per_bin=3)
    assert tied.edges.size == 0 and tied.counts == pytest.approx([6])


def test_pool_adjacent_violators_by_hand() -> None:
    assert pool_adjacent_violators(np.array([1.0, 3, 2, 4]), np.ones(4)) == pytest.approx([1, 2.5, 2.5, 4])
    # weights 1 and 3 on the violating pair: (3·1 + 2·3)/4 = 2.25
    assert pool_adjacent_violators(np.array([1.0, 3, 2, 4]), np.array([1.0, 1, 3, 1])) == pytest.approx(
        [1, 2.25, 2.25, 4]
    )


BINS = TopLabelBins(edges=np.array([0.5]), values=np.array([0.3, 0.6]), counts=np.array([10.0, 10.0]))


def test_binning_sets_the_top_and_rescales_the_rest() -> None:
    # c = 0.7 in bin 1: top 0.6, the others × (1 − 0.6)/(1 − 0.7) = 4/3.
    assert apply_top_label_bins(np.array([0.2, 0.7, 0.1]), BINS) == pytest.approx([0.8 / 3, 0.6, 0.4 / 3])
    # c = 0.55 in bin 1 raised to 0.6: the others × 0.4/0.45.
    assert apply_top_label_bins(np.array([0.3, 0.55, 0.15]), BINS) == pytest.approx(
        [0.3 * 0.4 / 0.45, 0.6, 0.15 * 0.4 / 0.45]
    )


def test_binning_never_moves_the_argmax() -> None:
    # c = 0.45 in bin 0 (value 0.3), runner-up 0.4 listed first: the top stops where the runner-up ties it,
    # 0.4/(1 − 0.45 + 0.4) = 8/19, and stays the argmax.
    binned = apply_top_label_bins(np.array([0.4, 0.45, 0.15]), BINS)
    assert binned == pytest.approx([8 / 19, 8 / 19, 3 / 19])
    assert binned.argmax() == 1 and binned.sum() == pytest.approx(1)
    # A certain answer has nothing to rescale and is left as it is; rows are binned one by one.
    rows = apply_top_label_bins(np.array([[1.0, 0.0], [0.3, 0.7]]), BINS)
    assert rows == pytest.approx(np.array([[1.0, 0.0], [0.4, 0.6]]))
