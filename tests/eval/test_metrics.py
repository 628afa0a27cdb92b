"""Every metric against a case worked out by hand (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest
from sklearn.metrics import cohen_kappa_score, f1_score

from slotread.eval.metrics import (
    accuracy,
    brier,
    coverage,
    expected_calibration_error,
    macro_f1,
    mcnemar_exact,
    mean_set_size,
    nll,
    percentile,
    precision_recall,
    quadratic_weighted_kappa,
    reliability_bins,
    summarise,
    within_one,
)


def test_accuracy_by_hand() -> None:
    assert accuracy(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2])) == 0.75


def test_macro_f1_by_hand() -> None:
    # gold [0, 0, 1, 2], predicted [0, 1, 1, 1]
    # class 0: TP 1, FP 0, FN 1 -> 2/3; class 1: TP 1, FP 2, FN 0 -> 2/4; class 2: TP 0, FN 1 -> 0
    # mean (2/3 + 1/2 + 0) / 3 = 7/18; class 3 occurs nowhere and is left out
    predicted, gold = np.array([0, 1, 1, 1]), np.array([0, 0, 1, 2])
    assert macro_f1(predicted, gold) == pytest.approx(7 / 18)
    assert f1_score(gold, predicted, average="macro", zero_division=0) == pytest.approx(7 / 18)


def test_macro_f1_counts_a_class_predicted_but_never_gold_as_zero() -> None:
    # class 0: TP 1 -> F1 1; class 1 (never gold): TP 0, FP 1 -> 0; class 2: TP 0, FN 1 -> 0
    assert macro_f1(np.array([0, 1]), np.array([0, 2])) == pytest.approx(1 / 3)


def test_ece_of_four_predictions_at_point_eight_with_two_right() -> None:
    # one bin, confidence 0.8, accuracy 0.5 -> |0.8 - 0.5| = 0.3
    p = np.array([[0.8, 0.2]] * 4)
    assert expected_calibration_error(p, np.array([0, 0, 1, 1])) == pytest.approx(0.3)


def test_ece_weights_bins_by_their_items() -> None:
    # bin of 0.95 (3 items, all right): |1 - 0.95| = 0.05; bin of 0.6 (1 item, wrong): |0 - 0.6| = 0.6
    # ECE = 3/4 * 0.05 + 1/4 * 0.6 = 0.1875
    p = np.array([[0.95, 0.05], [0.95, 0.05], [0.05, 0.95], [0.6, 0.4]])
    assert expected_calibration_error(p, np.array([0, 0, 1, 1])) == pytest.approx(0.1875)


def test_reliability_bins_are_fifteen_equal_width_bins_closed_on_the_right() -> None:
    # 1/3 = 5/15 is the upper edge of bin 4 (4/15, 5/15]; 0.34 falls in bin 5; 1.0 in bin 14
    p = np.array([[1 / 3, 1 / 3, 1 / 3], [0.34, 0.33, 0.33], [1.0, 0.0, 0.0]])
    bins = reliability_bins(p, np.array([0, 1, 0]))
    assert bins.edges.size == 16 and bins.edges[1] == pytest.approx(1 / 15)
    assert np.flatnonzero(bins.counts).tolist() == [4, 5, 14]
    assert bins.accuracy[[4, 5, 14]].tolist() == [1.0, 0.0, 1.0]
    assert np.isnan(bins.accuracy[0]) and np.isnan(bins.confidence[0])


def test_brier_by_hand() -> None:
    # item 1: (0.7-1)^2 + 0.2^2 + 0.1^2 = 0.14; item 2: 0.5^2 + (0.5-1)^2 + 0 = 0.5 -> mean 0.32
    p = np.array([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]])
    assert brier(p, np.array([0, 1])) == pytest.approx(0.32)
    assert brier(np.array([[0.5, 0.5]]), np.array([0])) == pytest.approx(0.5)  # 0.25 per class, summed


def test_nll_by_hand_and_clipped() -> None:
    # -(ln 0.5 + ln 0.25) / 2 = 1.5 ln 2
    p = np.array([[0.5, 0.5], [0.75, 0.25]])
    assert nll(p, np.array([0, 1])) == pytest.approx(1.5 * math.log(2))
    # a zero is clipped to 1e-12: -ln(1e-12) = 27.631
    assert nll(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(12 * math.log(10))


def test_quadratic_weighted_kappa_by_hand() -> None:
    # gold [0, 1, 2], predicted [0, 1, 1], weights (i - j)^2 / 4
    # observed: one item off by one -> sum w O = 1/4
    # expected = outer([1, 1, 1], [1, 2, 0]) / 3 -> sum w E = 1/6 + 1/12 + 1/2 = 3/4
    # kappa = 1 - (1/4) / (3/4) = 2/3
    predicted, gold = np.array([0, 1, 1]), np.array([0, 1, 2])
    assert quadratic_weighted_kappa(predicted, gold, 3) == pytest.approx(2 / 3)
    assert cohen_kappa_score(gold, predicted, weights="quadratic") == pytest.approx(2 / 3)


def test_quadratic_weighted_kappa_extremes() -> None:
    assert quadratic_weighted_kappa(np.array([0, 1, 2]), np.array([0, 1, 2]), 3) == pytest.approx(1.0)
    assert math.isnan(quadratic_weighted_kappa(np.array([1, 1]), np.array([1, 1]), 3))


def test_out_of_scope_precision_and_recall_by_hand() -> None:
    # class 0 = out of scope; gold [0, 0, 0, 1, 2], predicted [0, 0, 1, 1, 2]
    # TP 2, FP 0, FN 1 -> precision 1, recall 2/3
    precision, recall = precision_recall(np.array([0, 0, 1, 1, 2]), np.array([0, 0, 0, 1, 2]), positive=0)
    assert precision == 1.0 and recall == pytest.approx(2 / 3)
    # nothing predicted out of scope: precision undefined
    precision, recall = precision_recall(np.array([1, 2]), np.array([0, 2]), positive=0)
    assert math.isnan(precision) and recall == 0.0


def test_within_one_by_hand() -> None:
    assert within_one(np.array([0, 2, 4, 1]), np.array([1, 4, 4, 3])) == 0.5


def test_latency_percentiles_by_hand() -> None:
    # p50 of 10, 20, 30, 40: halfway between 20 and 30; p95: rank 0.95 * 3 = 2.85 -> 30 + 0.85 * 10
    latency = np.array([40.0, 10.0, 30.0, 20.0])
    assert percentile(latency, 50) == pytest.approx(25.0)
    assert percentile(latency, 95) == pytest.approx(38.5)


@pytest.mark.parametrize(
    ("a_only", "b_only", "p"),
    [
        (6, 1, 0.125),  # n = 7: 2 * (C(7,0) + C(7,1)) / 2^7 = 2 * 8/128
        (1, 6, 0.125),  # symmetric
        (0, 5, 0.0625),  # 2 / 2^5
        (3, 3, 1.0),  # 2 * 42/64 > 1 -> 1
        (0, 0, 1.0),  # no discordant pair
        (10, 0, 2 / 1024),
    ],
)
def test_mcnemar_exact_by_hand(a_only: int, b_only: int, p: float) -> None:
    assert mcnemar_exact(a_only, b_only) == pytest.approx(p)


def test_summarise_adds_the_metrics_each_task_has() -> None:
    p = np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.5, 0.4, 0.1]])
    gold = np.array([0, 1, 2, 1])
    latency = np.array([1.0, 2.0, 3.0, 4.0])
    plain = summarise(p, gold, ordinal=False, positive=None, latency_ms=latency, reads=None)
    assert set(plain) == {"accuracy", "macro_f1", "ece", "brier", "nll", "latency_p50_ms", "latency_p95_ms"}
    assert plain["accuracy"] == 0.75 and plain["latency_p50_ms"] == 2.5
    score = summarise(p, gold, ordinal=True, positive=2, latency_ms=latency, reads=np.array([1, 1, 2, 2]))
    assert {"qwk", "within_one", "oos_precision", "oos_recall"} <= set(score)
    assert score["reads_per_item"] == 1.5 and score["within_one"] == 1.0


def test_coverage_and_mean_set_size_by_hand() -> None:
    # gold 0 in {0, 1}: yes; gold 2 in {1}: no; gold 1 in {}: no; gold 2 in {0, 1, 2}: yes -> 2 / 4
    # sizes 2, 1, 0, 3 -> 6 / 4 = 1.5
    sets = [(0, 1), (1,), (), (0, 1, 2)]
    gold = np.array([0, 2, 1, 2])
    assert coverage(sets, gold) == 0.5
    assert mean_set_size(sets) == 1.5


def test_summarise_reports_sets_over_the_items_that_have_one() -> None:
    p = np.array([[0.6, 0.4], [0.3, 0.7], [0.9, 0.1]])
    gold = np.array([0, 0, 1])
    latency = np.ones(3)
    assert "coverage" not in summarise(p, gold, ordinal=False, positive=None, latency_ms=latency, reads=None)
    # item 1 has no set: gold 0 in {0}: yes; gold 1 in {0}: no -> coverage 1 / 2, sizes 1, 1 -> 1
    metrics = summarise(p, gold, ordinal=False, positive=None, latency_ms=latency, reads=None, sets=[(0,), None, (0,)])
    assert (metrics["coverage"], metrics["mean_set_size"]) == (0.5, 1.0)
