"""Example banks: labelled states per question schema, retrieved by similarity to the state asked about.

A bank holds solved cases (state, option name) for one question schema (``artifact.schema_hash``: the
question's type, instructions and options, and the request-wide instructions). Similarity is BM25
over the states (``quality.bm25``). Three uses:

- ``x_examples: k`` shows a question's k nearest examples in its prompt as solved cases (nearest
  last, just before the state; ``prompt.render``).
- ``x_shortlist: k`` reads only the options the nearest examples point to: the distinct labels of
  the ``max(x_examples, SHORTLIST_NEIGHBOURS)`` nearest examples, ordered by vote, at most k of them
  (at least 2: further examples are walked until a second label turns up, else the first other
  option is added). They are read as a smaller choice, listed in the question's own option order
  (so the listing does not carry the vote in as a position prior). The answer still gives every
  option a probability: with r the bank's residual mass, a shortlisted option gets (1 − r)·p_read
  and the n − m options outside the shortlist share r uniformly, r/(n − m) each. r is the share of
  bank examples whose own label falls outside their own shortlist, by leave-one-out over a seeded
  sample of at most ``RESIDUAL_SAMPLE`` examples, Laplace-smoothed: r = (misses + 1)/(sampled + 2),
  so no option ever gets probability 0. With x_examples as well, the examples shown are the nearest
  among those whose label is shortlisted (an example must be answerable in the read's labels).
- The neighbour vote (``vote``), a baseline with no model: the label distribution of the k nearest
  examples, see ``vote_distribution``.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from slotread.core.aggregate import ReadSummary, normalised_entropy, softmax
from slotread.core.answers import Answer, Read
from slotread.core.questions import Decision, Question
from slotread.errors import ErrorDetail, ExampleBankError, InvalidRequest
from slotread.prompt.render import SolvedExample
from slotread.quality.artifact import schema_hash
from slotread.quality.bm25 import BM25
from slotread.quality.meaning import Embed, nearest_options, similarity_distribution

#: Neighbours whose labels a shortlist is drawn from, unless x_examples shows more. Measured in
#: issue 6: the gold intent was among the labels of the 24 BM25-nearest BANKING77 train messages for
#: 152 of 154 subset154 messages.
SHORTLIST_NEIGHBOURS = 24
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


def expand_probabilities(
    read: np.ndarray, options: Sequence[int], n: int, residual: float, prior: np.ndarray | None = None
) -> np.ndarray:
    """A distribution over the m shortlisted ``options`` as one over all n: (1 − r)·p_read on the list,
    r/(n − m) on each other option (r = 0 when the list holds every option). With a ``prior`` q (n,) over
    all options (a meaning shortlist, r = the prior's mass off the list), each other option keeps q_i and
    the list's 1 − r is shared as normalise(√(p_read · q)) (``quality.meaning``)."""
    if prior is not None:
        full = np.array(prior, dtype=np.float64)
        pooled = np.sqrt(read * full[list(options)])
        full[list(options)] = (1 - residual) * pooled / pooled.sum()
        return full
    full = np.full(n, residual / (n - len(options)) if n > len(options) else 0.0)
    full[list(options)] = (1 - residual if n > len(options) else 1.0) * read
    return full


@dataclass(frozen=True)
class Shortlist:
    """The options a question is read over (indices into ``question.options``, in option order) and the
    residual mass r the others share."""

    question: Question
    options: tuple[int, ...]
    residual: float
    #: a meaning shortlist's encoder distribution over every option (``quality.meaning``): the options
    #: left out keep theirs, and ``residual`` is their sum; None for a bank's (uniform) shortlist
    prior: np.ndarray | None = None


class ExampleBank:
    """Solved cases of one question schema, searchable by state.

    ``question`` and ``instructions`` (request-wide) define the schema; every example's answer must
    name one of the question's options (ExampleBankError otherwise, naming ``source``).
    """

    def __init__(
        self, question: Question, instructions: str | None, examples: Sequence[SolvedExample], source: str
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
        self._index = BM25([e.state for e in examples])
        self._residuals: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pairs(
        cls, question: Question, instructions: str | None, pairs: Sequence[tuple[str, str]], source: str
    ) -> ExampleBank:
        """A bank from (state, option name) pairs."""
        return cls(question, instructions, [SolvedExample(state, answer) for state, answer in pairs], source)

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
    """The example banks a Decider serves, by schema; ExampleBankError if two serve one schema."""

    def __init__(self, banks: Sequence[ExampleBank] = ()) -> None:
        self._banks: dict[str, ExampleBank] = {}
        for bank in banks:
            other = self._banks.get(bank.schema)
            if other is not None:
                raise ExampleBankError(f"{bank.source} and {other.source} are banks of the same question schema")
            self._banks[bank.schema] = bank

    def __len__(self) -> int:
        return len(self._banks)

    def get(self, schema: str) -> ExampleBank | None:
        """The bank of a schema, if one is served."""
        return self._banks.get(schema)


def retrieve(
    decision: Decision, banks: ExampleBanks, embed: Embed | None = None
) -> tuple[Decision, dict[str, Shortlist]]:
    """The decision as read: each question with its solved examples and, with ``decision.shortlist``,
    only its shortlisted options; and the shortlists by question id (to expand the answers with).
    A shortlist asked without examples of a question no bank serves comes from meaning
    (``quality.meaning``) when ``embed`` (a sentence encoder) is given.

    Raises InvalidRequest when a question has no bank (and no encoder can stand in), or a shortlist is
    asked of a noul or score.
    """
    if not decision.examples and not decision.shortlist:
        return decision, {}
    field = "x_examples" if decision.examples else "x_shortlist"
    problems: list[ErrorDetail] = []
    questions = []
    shortlists: dict[str, Shortlist] = {}
    for question in decision.questions:
        schema = schema_hash(question, decision.instructions)
        bank = banks.get(schema)
        by_meaning = bank is None and embed is not None and not decision.examples
        if bank is None and not by_meaning:
            msg = (
                f"no example bank serves question {question.id!r} (schema {schema[:16]}); "
                "serve one for this question with --example-bank"
            )
            if not decision.examples:
                msg += " (or load a sentence encoder, --encoder, for shortlists from meaning)"
            problems.append({"loc": ["body", field], "msg": msg, "type": "value_error"})
            continue
        if decision.shortlist and question.kind != "choice":
            msg = f"x_shortlist reads a subset of a choice's options; question {question.id!r} is a {question.kind}"
            problems.append({"loc": ["body", "x_shortlist"], "msg": msg, "type": "value_error"})
            continue
        if by_meaning:
            assert embed is not None
            questions.append(_meaning(question, decision, embed, shortlists))
            continue
        assert bank is not None
        read, shortlist = _prepare(question, decision, bank)
        questions.append(read)
        if shortlist is not None:
            shortlists[question.id] = shortlist
    if problems:
        raise InvalidRequest(problems)
    return replace(decision, questions=tuple(questions)), shortlists


def _meaning(question: Question, decision: Decision, embed: Embed, shortlists: dict[str, Shortlist]) -> Question:
    """The question as read over its meaning shortlist (recorded in ``shortlists``)."""
    prior = similarity_distribution(question, decision.state, embed)
    if decision.shortlist >= len(question.options):
        return question
    options = nearest_options(prior, decision.shortlist)
    residual = float(1 - prior[list(options)].sum())
    shortlists[question.id] = Shortlist(question, options, residual, prior)
    return replace(question, options=tuple(question.options[i] for i in options))


def _prepare(question: Question, decision: Decision, bank: ExampleBank) -> tuple[Question, Shortlist | None]:
    if not decision.shortlist:
        shown = bank.ranking(decision.state, decision.examples)
        return replace(question, examples=bank.solved(shown[::-1])), None
    neighbours = max(decision.examples, SHORTLIST_NEIGHBOURS)
    options = bank.shortlist_options(decision.state, decision.shortlist, neighbours)
    listed = set(options)
    shown = [i for i in bank.ranking(decision.state, len(bank)) if bank.labels[i] in listed][: decision.examples]
    read = replace(question, options=tuple(question.options[i] for i in options), examples=bank.solved(shown[::-1]))
    return read, Shortlist(question, options, bank.residual(decision.shortlist, neighbours))


def expand_answer(answer: Answer, shortlist: Shortlist) -> Answer:
    """The answer over the shortlisted options as an answer to the whole question (module docstring).

    Each read's logits become log-probabilities over every option, so the reads and the summary agree;
    the summary's standard errors scale by (1 − r) on the list and are 0 off it (a meaning shortlist's
    answer has none: its pool is not linear in the read).
    """
    n = len(shortlist.question.options)
    options = shortlist.options

    def full(p: np.ndarray) -> np.ndarray:
        return expand_probabilities(p, options, n, shortlist.residual, shortlist.prior)

    reads = tuple(
        Read(r.shift, np.log(np.maximum(full(softmax(r.logits)), 1e-300)), r.label_mass) for r in answer.reads
    )
    summary = answer.summary
    probabilities = full(summary.probabilities)
    stderr = None
    if summary.stderr is not None and shortlist.prior is None:  # the pool of a meaning shortlist is not linear
        stderr = full(summary.stderr)
        stderr[[i for i in range(n) if i not in set(options)]] = 0.0
    expanded = ReadSummary(probabilities, stderr, summary.agreement, normalised_entropy(probabilities), summary.reads)
    return Answer(shortlist.question, expanded, reads, thought=answer.thought)
