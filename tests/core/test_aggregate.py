import numpy as np
import pytest

from slotread.core.aggregate import aggregate_reads, normalised_entropy, softmax


def test_softmax_by_hand() -> None:
    p = softmax(np.array([0.0, np.log(3.0)]))
    assert p == pytest.approx([0.25, 0.75])


def test_softmax_ignores_a_constant_shift_and_sums_to_one() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=255) * 30
    assert softmax(logits) == pytest.approx(softmax(logits + 1000.0), abs=1e-12)
    assert abs(softmax(logits).sum() - 1.0) < 1e-12


def test_softmax_of_huge_logits_is_finite() -> None:
    p = softmax(np.array([1e30, 0.0, -1e30]))
    assert np.isfinite(p).all() and p[0] == 1.0


def test_entropy_is_zero_for_certain_and_one_for_uniform() -> None:
    assert normalised_entropy(np.array([1.0, 0.0, 0.0])) == 0.0
    assert normalised_entropy(np.full(7, 1 / 7)) == pytest.approx(1.0)
    # two of four options at 1/2: log 2 / log 4 = 0.5
    assert normalised_entropy(np.array([0.5, 0.5, 0.0, 0.0])) == pytest.approx(0.5)


def reads(*logits: list[float]) -> np.ndarray:
    return softmax(np.array(logits))


def test_one_read_has_no_spread() -> None:
    summary = aggregate_reads(reads([0.0, np.log(3.0)]))
    assert summary.reads == 1 and summary.stderr is None and summary.agreement is None
    assert summary.probabilities == pytest.approx([0.25, 0.75])


def test_reads_by_hand() -> None:
    # read 1: p = (0.25, 0.75); read 2: p = (0.75, 0.25) -> mean (0.5, 0.5),
    # sample std of each option = |0.25 - 0.75| / sqrt(2) = 0.35355, stderr = std / sqrt(2) = 0.25
    summary = aggregate_reads(reads([0.0, np.log(3.0)], [np.log(3.0), 0.0]))
    assert summary.probabilities == pytest.approx([0.5, 0.5])
    assert summary.stderr == pytest.approx([0.25, 0.25])
    assert summary.entropy == pytest.approx(1.0)


def test_agreement_counts_reads_that_pick_the_mean_top() -> None:
    summary = aggregate_reads(reads([2.0, 0.0], [2.0, 0.0], [0.0, 0.5]))
    assert summary.probabilities.argmax() == 0
    assert summary.agreement == pytest.approx(2 / 3)
