"""The readout head's logistic regression, checked where the optimum is known."""

import math

import numpy as np
import pytest

from slotread.quality.readouts.logistic import LogisticHead, fit_logistic, standardiser


def test_standardiser_by_hand() -> None:
    mean, scale = standardiser(np.array([[1.0, 5.0], [3.0, 5.0]]))
    assert mean.tolist() == [2.0, 5.0]
    assert scale.tolist() == [1.0, 1.0]  # std 1, and a constant column left unscaled


def test_scores_by_hand() -> None:
    head = LogisticHead(np.array([1.0]), np.array([2.0]), np.array([[1.0], [-1.0]]), np.array([0.5, 0.0]))
    # z = (5 - 1) / 2 = 2: scores [2 + 0.5, -2]
    assert head.scores(np.array([[5.0]])).tolist() == [[2.5, -2.0]]


def test_two_symmetric_items_reach_the_stationary_point() -> None:
    # x = +1 (class 0) and x = -1 (class 1) standardise to z = ±1; by symmetry b = 0 and W = [w, -w], so
    # the loss is -log σ(2w) + λw², whose minimum solves λw = 1 - σ(2w).
    l2 = 0.1
    head = fit_logistic(np.array([[1.0], [-1.0]]), np.array([0, 1]), 2, l2)
    w = head.weight[0, 0]
    assert head.weight[1, 0] == pytest.approx(-w, abs=1e-4)
    assert head.bias == pytest.approx([0.0, 0.0], abs=1e-4)
    assert l2 * w == pytest.approx(1 - 1 / (1 + math.exp(-2 * w)), abs=1e-4)


def test_a_separable_three_class_problem_is_learned() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[3.0, 0.0], [0.0, 3.0], [-3.0, -3.0]])
    gold = np.repeat(np.arange(3), 20)
    features = centres[gold] + rng.normal(scale=0.5, size=(60, 2))
    head = fit_logistic(features, gold, 3, 1e-3)
    assert (head.scores(features).argmax(axis=1) == gold).all()
