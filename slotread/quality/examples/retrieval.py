"""How an example bank ranks its examples against a state: by words, by meaning, or by both.

- ``bm25``: BM25 over the states' words (``quality.examples.bm25``). The default: the learned readouts
  were fitted with BM25 votes, and a readout serves only with the retrieval it was fitted with.
- ``dense``: the cosine similarity of the sentence encoder's unit-length embeddings (``models.encoder``),
  s_i = e_i · e_q. The bank's embeddings are computed once, when the bank is built; a paraphrase that
  shares no word with the state is found.
- ``hybrid``: reciprocal-rank fusion (Cormack, Clarke and Büttcher 2009) of the two rankings,

      score(i) = [s_bm25(i) > 0] / (RRF_K + rank_bm25(i)) + 1 / (RRF_K + rank_dense(i))

  with rank_x(i) the example's place (1 = nearest) in ranking x over the whole bank, and an example
  that shares no word with the state (BM25 score 0) given no BM25 term: its BM25 place among the
  unmatched is arbitrary. RRF_K = 60, the paper's constant: fusing ranks, not scores, needs no scale
  between BM25's unbounded scores and cosines, and no weight fitted on labels.

Every ranking breaks ties toward the earlier example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from slotread.quality.examples.bm25 import BM25
from slotread.quality.examples.meaning import Embed

Retrieval = Literal["bm25", "dense", "hybrid"]
RETRIEVALS: tuple[Retrieval, ...] = get_args(Retrieval)
#: The reciprocal-rank fusion constant k of 1/(k + rank).
RRF_K = 60


def order(scores: np.ndarray) -> np.ndarray:
    """Indices by score, highest first, ties to the lower index (a stable sort: half a lexsort's time)."""
    return np.argsort(-scores, kind="stable")


def places(scores: np.ndarray) -> np.ndarray:
    """Each index's place (1 = highest score) in ``order(scores)``."""
    found = np.empty(len(scores), dtype=np.int64)
    found[order(scores)] = np.arange(1, len(scores) + 1)
    return found


def fused(bm25: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The hybrid score of every example from its BM25 and dense scores (the module docstring's formula)."""
    return (bm25 > 0) / (RRF_K + places(bm25)) + 1 / (RRF_K + places(dense))


class Retriever:
    """Ranks ``states`` against a query by ``retrieval``; ``embed`` (a sentence encoder) is needed for
    dense and hybrid (ValueError without one). The states are embedded here, once."""

    def __init__(self, states: Sequence[str], retrieval: Retrieval, embed: Embed | None) -> None:
        if retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {', '.join(RETRIEVALS)}, not {retrieval!r}")
        if retrieval != "bm25" and embed is None:
            raise ValueError(f"{retrieval} retrieval needs a sentence encoder")
        self.retrieval = retrieval
        self.size = len(states)
        self._bm25 = BM25(states) if retrieval != "dense" else None
        self._embed = embed
        self._vectors = embed(list(states)) if embed is not None and retrieval != "bm25" else None

    def scores(self, query: str, exclude: int | None = None) -> np.ndarray:
        """Every state's score against ``query``, higher nearer (BM25, cosine, or the fused score);
        ``exclude``: an index scored −∞, before fusing, so the others' places are as if it were not there."""
        words = self._bm25.scores(query) if self._bm25 is not None else None
        cosines = None
        if self._vectors is not None:
            assert self._embed is not None
            cosines = (self._vectors @ self._embed([query])[0]).astype(np.float64)
        for found in (words, cosines):
            if found is not None and exclude is not None:
                found[exclude] = -np.inf
        if words is not None and cosines is not None:
            return fused(words, cosines)
        found = words if words is not None else cosines
        assert found is not None
        return found

    def top(self, query: str, k: int, exclude: int | None = None) -> list[int]:
        """The indices of the ``k`` nearest states, nearest first; ``exclude``: an index left out."""
        ranked = order(self.scores(query, exclude))
        if exclude is not None:
            ranked = ranked[ranked != exclude]
        return [int(i) for i in ranked[:k]]
