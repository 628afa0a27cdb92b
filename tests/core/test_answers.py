import numpy as np
import pytest

from slotread.core.answers import choice_confidence, score_confidence, score_expectation


def test_choice_confidence_by_hand() -> None:
    assert choice_confidence(np.array([0.7, 0.2, 0.1])) == pytest.approx(0.55)


def test_choice_confidence_bounds() -> None:
    assert choice_confidence(np.full(4, 0.25)) == pytest.approx(0.0)
    assert choice_confidence(np.array([1.0, 0.0])) == pytest.approx(1.0)


def test_score_expectation_is_zero_indexed() -> None:
    assert score_expectation(np.array([0.1, 0.2, 0.7])) == pytest.approx(1.6)
    assert score_expectation(np.array([1.0, 0.0, 0.0])) == 0.0


def test_score_confidence_by_hand() -> None:
    # k = 2, sum p_i |i - k| = 0.1*2 + 0.2*1 = 0.4, D = (1 + 0 + 1)/3 = 2/3 -> 1 - 0.6 = 0.4
    assert score_confidence(np.array([0.1, 0.2, 0.7])) == pytest.approx(0.4)


def test_score_confidence_is_clamped_at_zero() -> None:
    # k = 0 (first of ties), sum p_i |i - k| = 0.5 * 4 = 2, D = (2+1+0+1+2)/5 = 1.2 -> max(0, 1 - 1.67)
    assert score_confidence(np.array([0.5, 0, 0, 0, 0.5])) == 0.0
    assert score_confidence(np.eye(10)[3]) == pytest.approx(1.0)
