"""Example banks: labelled states per question schema, searchable by similarity to the state asked about.

A bank holds solved cases (state, option name) for one question schema (``quality.artifact.schema_hash``:
the question's type, instructions and options, and the request-wide instructions). Similarity is
BM25 over the states by default, or a sentence encoder's cosine, or both fused (the bank's
``retrieval``, ``quality.examples.retrieval``; ``--retrieval``). A bank serves solved examples and shortlists
(``quality.examples.shortlist``), the classifiers of a readout's partners (``lexical``, ``dense``),
and the neighbour vote (``ExampleBank.vote``), a baseline with no model and a readout's partner: the
smoothed label distribution of the k nearest examples, see ``vote_distribution``. A shortlist's
residual mass r (the share of bank examples whose own label falls outside their own shortlist) is
estimated here, by leave-one-out over a seeded sample of at most ``RESIDUAL_SAMPLE`` examples.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from slotread.core.questions import Question
from slotread.errors import ExampleBankError
from slotread.prompt.render import SolvedExample
from slotread.quality.artifact import schema_hash
from slotread.quality.examples.meaning import Embed
from slotread.quality.examples.retrieval import Retrieval, Retriever

#: Bank examples the residual mass r is estimated on (leave-one-out), and the sample's seed.
RESIDUAL_SAMPLE = 1000
RESIDUAL_SEED = 0
#: The neighbour vote's pseudo count: one vote spread uniformly over the options.
VOTE_PSEUDO_COUNT = 1.0
#: How much more a nearer neighbour's vote weighs, at most (the nearest vs none): only breaks ties.
VOTE_TIE_BREAK = 1e-3


def neighbour_weights(k: int) -> np.ndarray:
    """The vote of the neighbour at rank j (0 nearest): 1 + VOTE_TIE_BREAK·(k − j)/k."""
    return 1 + VOTE_TIE_BREAK * (k - np.arange(k)) / max(k, 1)


def vote_distribution(
    labels: Sequence[int] | np.ndarray, n: int, pseudo_count: float = VOTE_PSEUDO_COUNT
) -> np.ndarray:
    """The smoothed vote of neighbours with these option ``labels`` (nearest first) over n options.

    p_i = (v_i + c/n) / (W + c): v_i the summed weights (``neighbour_weights``) of the neighbours
    labelled i, W all their weights, c the pseudo count. Sums to 1; uniform with no neighbours.
    """
    votes = np.zeros(n)
    weights = neighbour_weights(len(labels))
    np.add.at(votes, np.asarray(labels, dtype=np.int64), weights)
    return (votes + pseudo_count / n) / (weights.sum() + pseudo_count)


def residual_mass(misses: int, sampled: int) -> float:
    """The Laplace-smoothed share of examples whose label missed their shortlist: (misses + 1)/(sampled + 2)."""
    return (misses + 1) / (sampled + 2)


def _refuse_without_encoder(retrieval: Retrieval, embed: Embed | None, where: str = "") -> None:
    """ExampleBankError (its message after ``where``) when dense or hybrid retrieval has no ``embed``."""
    if retrieval != "bm25" and embed is None:
        raise ExampleBankError(
            f"{where}--retrieval {retrieval} ranks bank examples by their sentence embeddings; "
            "load a sentence encoder (--encoder all-minilm-l6-v2) or use --retrieval bm25"
        )


class ExampleBank:
    """Solved cases of one question schema, searchable by state.

    ``question`` and ``instructions`` (request-wide) define the schema; every example's answer must
    name one of the question's options (ExampleBankError otherwise, naming ``source``). ``retrieval``
    ranks the examples (``quality.examples.retrieval``); dense and hybrid embed them here with ``embed``,
    once (ExampleBankError, naming the flag, without an encoder).
    """

    def __init__(
        self,
        question: Question,
        instructions: str | None,
        examples: Sequence[SolvedExample],
        source: str,
        *,
        retrieval: Retrieval = "bm25",
        embed: Embed | None = None,
    ) -> None:
        names = [option.name for option in question.options]
        if not examples:
            raise ExampleBankError(f"{source}: the bank holds no examples")
        unknown = next((e.answer for e in examples if e.answer not in names), None)
        if unknown is not None:
            raise ExampleBankError(f"{source}: answer {unknown!r} is not an option of the bank's question")
        self.question = question
        self.instructions = instructions
        self.examples = tuple(examples)
        self.source = source
        self.schema = schema_hash(question, instructions)
        self.labels = np.array([names.index(e.answer) for e in examples], dtype=np.int64)
        self._repeats = Counter(e.state for e in examples)
        _refuse_without_encoder(retrieval, embed, f"{source}: ")
        self.retrieval = retrieval
        self.embed = embed
        self._index = Retriever([e.state for e in examples], retrieval, embed)
        self._residuals: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pairs(
        cls,
        question: Question,
        instructions: str | None,
        pairs: Sequence[tuple[str, str]],
        source: str,
        *,
        retrieval: Retrieval = "bm25",
        embed: Embed | None = None,
    ) -> ExampleBank:
        """A bank from (state, option name) pairs."""
        examples = [SolvedExample(state, answer) for state, answer in pairs]
        return cls(question, instructions, examples, source, retrieval=retrieval, embed=embed)

    def retrieving(self, retrieval: Retrieval, embed: Embed | None) -> ExampleBank:
        """This bank ranked by ``retrieval`` (itself when it already is; ExampleBankError without an encoder
        for dense and hybrid)."""
        if retrieval == self.retrieval:
            return self
        return ExampleBank(
            self.question, self.instructions, self.examples, self.source, retrieval=retrieval, embed=embed
        )

    def __len__(self) -> int:
        return len(self.examples)

    def ranking(self, state: str, k: int, exclude: int | None = None) -> list[int]:
        """The k examples nearest ``state`` (indices, nearest first)."""
        return self._index.top(state, k, exclude)

    def vote(self, state: str, k: int, leave_out: bool = False) -> np.ndarray:
        """The smoothed label vote of the k nearest examples over the question's options.

        ``leave_out``: skip the examples whose state is ``state`` (a bank example asked about itself,
        and its repeats), as a vote at answer time never sees the state asked about.
        """
        ranked = self.ranking(state, k + (self._repeats[state] if leave_out else 0))
        if leave_out:
            ranked = [i for i in ranked if self.examples[i].state != state][:k]
        return vote_distribution(self.labels[ranked], len(self.question.options))

    def shortlist_options(self, state: str, size: int, neighbours: int, exclude: int | None = None) -> tuple[int, ...]:
        """The options the nearest examples point to (see the module docstring), in option order."""
        order = self.ranking(state, len(self), exclude)
        labels = self.labels[order]
        votes = vote_distribution(labels[:neighbours], len(self.question.options))
        voted = sorted(set(labels[:neighbours].tolist()), key=lambda i: -votes[i])[:size]
        further = iter(labels[neighbours:].tolist())
        while len(voted) < min(2, size):
            extra = next(further, None)
            if extra is None:  # the bank knows one label: add the first other option
                extra = next(i for i in range(len(self.question.options)) if i not in voted)
            if extra not in voted:
                voted.append(extra)
        return tuple(sorted(voted))

    def residual(self, size: int, neighbours: int) -> float:
        """r for shortlists of ``size`` from ``neighbours``: leave-one-out over a seeded sample (cached)."""
        key = (size, neighbours)
        with self._lock:
            if key not in self._residuals:
                count = min(len(self), RESIDUAL_SAMPLE)
                sample = random.Random(RESIDUAL_SEED).sample(range(len(self)), count)
                misses = sum(
                    int(self.labels[i]) not in self.shortlist_options(self.examples[i].state, size, neighbours, i)
                    for i in sample
                )
                self._residuals[key] = residual_mass(misses, count)
            return self._residuals[key]

    def solved(self, indices: Sequence[int]) -> tuple[SolvedExample, ...]:
        """The examples at ``indices``, in that order."""
        return tuple(self.examples[i] for i in indices)


class ExampleBanks:
    """The example banks a Decider serves, by schema, each ranked by ``retrieval`` (a bank ranked otherwise is
    re-ranked, ``ExampleBank.retrieving``). ExampleBankError if two serve one schema, or for dense and hybrid
    retrieval without a sentence encoder's ``embed``."""

    def __init__(
        self, banks: Sequence[ExampleBank] = (), retrieval: Retrieval = "bm25", embed: Embed | None = None
    ) -> None:
        _refuse_without_encoder(retrieval, embed)
        self.retrieval = retrieval
        self._banks: dict[str, ExampleBank] = {}
        for bank in (bank.retrieving(retrieval, embed) for bank in banks):
            other = self._banks.get(bank.schema)
            if other is not None:
                raise ExampleBankError(f"{bank.source} and {other.source} are banks of the same question schema")
            self._banks[bank.schema] = bank

    def __len__(self) -> int:
        return len(self._banks)

    def get(self, schema: str) -> ExampleBank | None:
        """The bank of a schema, if one is served."""
        return self._banks.get(schema)
