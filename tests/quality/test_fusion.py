"""Fitting the readout's temperature and its partners' weights on held-out items."""

import numpy as np
import pytest

from slotread.core.aggregate import softmax
from slotread.quality.calibration.methods import fit_temperature, mean_nll
from slotread.quality.readouts.fusion import WEIGHT_MAX, fit_fusion


def test_without_partners_it_is_temperature_scaling() -> None:
    rng = np.random.default_rng(1)
    gold = rng.integers(0, 5, 300)
    scores = rng.normal(size=(300, 1, 5))
    scores[np.arange(300), 0, gold] += 2.0
    temperature, weights = fit_fusion(scores, [], gold)
    assert weights == () and temperature == pytest.approx(fit_temperature(scores, gold), rel=1e-5)


def test_the_fitted_weights_follow_what_each_partner_knows() -> None:
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 4, 400)
    scores = rng.normal(size=(400, 1, 4))  # a head that knows nothing
    knowing = np.full((400, 4), 0.1)
    knowing[np.arange(400), gold] = 0.7  # right every time, at 0.7
    blind = rng.dirichlet(np.ones(4), 400)  # knows nothing
    temperature, (knowing_weight, blind_weight) = fit_fusion(scores, [knowing, blind], gold)
    assert knowing_weight > 2 and blind_weight < 0.2 and temperature > 5  # the head is flattened


def test_the_fit_is_the_minimum_in_its_box() -> None:
    """The NLL at the fitted point is no higher than at nearby points inside the bounds (convex: global)."""
    rng = np.random.default_rng(2)
    gold = rng.integers(0, 6, 500)
    scores = rng.normal(size=(500, 1, 6))
    scores[np.arange(500), 0, gold] += 1.0
    onehot = np.eye(6)[gold]
    vote, lexical = (softmax(onehot + rng.normal(size=(500, 6))) for _ in range(2))
    temperature, (w_v, w_l) = fit_fusion(scores, [vote, lexical], gold)
    assert 0 < w_v < WEIGHT_MAX and 0 < w_l < WEIGHT_MAX  # inside the box: every nudge below is allowed

    def nll(a: float, v: float, lex: float) -> float:
        return mean_nll(a * scores + v * np.log(vote)[:, None] + lex * np.log(lexical)[:, None], gold)

    best = nll(1 / temperature, w_v, w_l)
    for delta in np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, -1, 1]]) * 0.01:
        for sign in (1, -1):
            assert nll(*(np.array([1 / temperature, w_v, w_l]) + sign * delta)) >= best - 1e-12


def test_a_prior_keeps_a_small_fit_off_its_bounds() -> None:
    """Ten items that the partner separates: unshrunk, its weight runs to the cap; shrunk, T and it stay near 1."""
    rng = np.random.default_rng(3)
    gold = np.arange(10) % 5
    scores = rng.normal(size=(10, 1, 5))
    scores[np.arange(10), 0, gold] += 3.0
    partner = np.full((10, 5), 0.05)
    partner[np.arange(10), gold] = 0.8
    temperature, (weight,) = fit_fusion(scores, [partner], gold)
    assert weight == pytest.approx(WEIGHT_MAX)  # the cap
    temperature, (shrunk,) = fit_fusion(scores, [partner], gold, prior_items=20)
    assert 0.5 < temperature < 1.5 and 0.5 < shrunk < 2
    # the prior's pull fades with the items: 100 times the data moves the weight further from 1
    many = np.tile(gold, 100)
    big_scores, big_partner = np.tile(scores, (100, 1, 1)), np.tile(partner, (100, 1))
    _, (w_big,) = fit_fusion(big_scores, [big_partner], many, prior_items=20)
    _, (w_free,) = fit_fusion(big_scores, [big_partner], many)
    assert w_big > 1.5 * shrunk and w_free == pytest.approx(WEIGHT_MAX)
