"""BM25 against scores worked out by hand."""

import math

import numpy as np
import pytest

from slotread.quality.examples.bm25 import BM25, words


def test_words_are_lower_cased_runs_of_letters_and_digits() -> None:
    assert words("My PIN, card-4 blocked!") == ["my", "pin", "card", "4", "blocked"]


def test_a_score_by_hand() -> None:
    # N = 3, lengths 2, 1, 3 (mean 2). "card" is in documents 0 and 2 (df 2), "lost" only in 0 (df 1).
    index = BM25(["card lost", "refund", "card card please"])
    idf_card = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    idf_lost = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))

    def term(idf: float, tf: int, length: int) -> float:
        return idf * tf * 2.5 / (tf + 1.5 * (1 - 0.75 + 0.75 * length / 2))

    expected = [term(idf_card, 1, 2) + term(idf_lost, 1, 2), 0.0, term(idf_card, 2, 3)]
    # a repeated query word counts once; an unknown one adds nothing
    assert index.scores("lost card card unknown") == pytest.approx(expected)


def test_top_ranks_best_first_breaks_ties_by_order_and_can_leave_one_out() -> None:
    index = BM25(["red apple", "green apple", "red red red car", "blue sky"])
    assert index.top("red", 2) == [2, 0]
    assert index.top("apple", 3) == [0, 1, 2]  # 0 and 1 tie: the earlier first; then score 0 by order
    assert index.top("red", 2, exclude=2) == [0, 1]
    assert np.all(index.scores("nothing shared") == 0)
