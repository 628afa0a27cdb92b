"""BM25 ranking of short texts: which documents of a collection are most similar to a query.

For a query q and a document d of length |d| (words), with N documents of mean length L:

    score(q, d) = Σ_{t ∈ q} idf(t) · tf(t, d)·(k1 + 1) / (tf(t, d) + k1·(1 − b + b·|d|/L))
    idf(t)      = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5))

with tf the term's count in d, df the number of documents holding it, and each distinct query term
counted once. k1 = 1.5 and b = 0.75 are the usual defaults; this idf (Lucene's) is never negative.
Words are lower-cased runs of letters and digits (``\\w+``). Each term's per-document weights are
computed once, so a query costs one vector addition per distinct query term.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

K1 = 1.5
B = 0.75
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The terms BM25 sees in a text: lower-cased runs of letters and digits."""
    return _WORD.findall(text.lower())


class BM25:
    """A BM25 index over ``documents``; ``scores`` and ``top`` rank them against a query."""

    def __init__(self, documents: Sequence[str], k1: float = K1, b: float = B) -> None:
        counts = [Counter(words(text)) for text in documents]
        lengths = np.array([sum(c.values()) for c in counts], dtype=np.float64)
        self.size = len(documents)
        mean_length = float(lengths.mean()) if self.size and lengths.sum() else 1.0
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for index, count in enumerate(counts):
            for term, occurrences in count.items():
                docs, tfs = postings.setdefault(term, ([], []))
                docs.append(index)
                tfs.append(occurrences)
        #: term → (document indices, that term's BM25 weight in each)
        self._weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for term, (docs, tfs) in postings.items():
            ids = np.array(docs, dtype=np.int64)
            tf = np.array(tfs, dtype=np.float64)
            idf = math.log(1 + (self.size - len(docs) + 0.5) / (len(docs) + 0.5))
            norm = k1 * (1 - b + b * lengths[ids] / mean_length)
            self._weights[term] = (ids, idf * tf * (k1 + 1) / (tf + norm))

    def scores(self, query: str) -> np.ndarray:
        """The score of every document against ``query`` (0 where they share no term)."""
        total = np.zeros(self.size)
        for term in set(words(query)):
            found = self._weights.get(term)
            if found is not None:
                total[found[0]] += found[1]  # a posting list holds each document once
        return total

    def top(self, query: str, k: int, exclude: int | None = None) -> list[int]:
        """The indices of the ``k`` best-scoring documents, best first; ties go to the earlier document.

        ``exclude``: a document index left out (a bank example asked about itself).
        """
        scores = self.scores(query)
        order = np.lexsort((np.arange(self.size), -scores))  # by score descending, then index
        if exclude is not None:
            order = order[order != exclude]
        return [int(i) for i in order[:k]]
