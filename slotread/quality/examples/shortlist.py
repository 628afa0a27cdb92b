"""Solved examples and shortlists: a question as read with its example bank (or a sentence encoder).

- ``x_examples: k`` shows a question's k nearest bank examples in its prompt as solved cases (nearest
  last, just before the state; ``prompt.render``).
- ``x_shortlist: k`` reads only the options the nearest examples point to: the distinct labels of
  the ``max(x_examples, SHORTLIST_NEIGHBOURS)`` nearest examples, ordered by vote, at most k of them
  (at least 2: further examples are walked until a second label turns up, else the first other
  option is added). They are read as a smaller choice, listed in the question's own option order
  (so the listing does not carry the vote in as a position prior). The answer still gives every
  option a probability: with r the bank's residual mass (``ExampleBank.residual``), a shortlisted
  option gets (1 − r)·p_read and the n − m options outside the shortlist share r uniformly, r/(n − m)
  each; r = (misses + 1)/(sampled + 2), so no option ever gets probability 0. With x_examples as well,
  the examples shown are the nearest among those whose label is shortlisted (an example must be
  answerable in the read's labels). A question no bank serves is shortlisted from meaning instead
  when a sentence encoder is loaded (``quality.examples.meaning``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from slotread.core.aggregate import ReadSummary, normalised_entropy, softmax
from slotread.core.answers import Answer, Read
from slotread.core.questions import Decision, Question
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.quality.artifact import schema_hash
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.meaning import Embed, nearest_options, pool, similarity_distribution

#: Neighbours whose labels a shortlist is drawn from, unless x_examples shows more. Measured in
#: issue 6: the gold intent was among the labels of the 24 BM25-nearest BANKING77 train messages for
#: 152 of 154 subset154 messages.
SHORTLIST_NEIGHBOURS = 24


def expand_probabilities(
    read: np.ndarray, options: Sequence[int], n: int, residual: float, prior: np.ndarray | None = None
) -> np.ndarray:
    """A distribution over the m shortlisted ``options`` as one over all n: (1 − r)·p_read on the list,
    r/(n − m) on each other option (r = 0 when the list holds every option). With a ``prior`` q (n,) over
    all options (a meaning shortlist, r = the prior's mass off the list), each other option keeps q_i and
    the list's 1 − r is shared as normalise((p_read · q)^w) (``quality.examples.meaning.pool``)."""
    if prior is not None:
        return pool(read, prior, options)
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
    #: a meaning shortlist's encoder distribution over every option (``quality.examples.meaning``): the options
    #: left out keep theirs, and ``residual`` is their sum; None for a bank's (uniform) shortlist
    prior: np.ndarray | None = None


def retrieve(
    decision: Decision, banks: ExampleBanks, embed: Embed | None = None
) -> tuple[Decision, dict[str, Shortlist]]:
    """The decision as read: each question with its solved examples and, with ``decision.quality.shortlist``,
    only its shortlisted options; and the shortlists by question id (to expand the answers with).
    A shortlist asked without examples of a question no bank serves comes from meaning
    (``quality.examples.meaning``) when ``embed`` (a sentence encoder) is given.

    Raises InvalidRequest when a question has no bank (and no encoder can stand in), or a shortlist is
    asked of a noul or score.
    """
    if not decision.quality.examples and not decision.quality.shortlist:
        return decision, {}
    field = "x_examples" if decision.quality.examples else "x_shortlist"
    problems: list[ErrorDetail] = []
    questions = []
    shortlists: dict[str, Shortlist] = {}
    for question in decision.questions:
        schema = schema_hash(question, decision.instructions)
        bank = banks.get(schema)
        by_meaning = bank is None and embed is not None and not decision.quality.examples
        if bank is None and not by_meaning:
            msg = (
                f"no example bank serves question {question.id!r} (schema {schema[:16]}); "
                "serve one for this question with --example-bank"
            )
            if not decision.quality.examples:
                msg += " (or load a sentence encoder, --encoder, for shortlists from meaning)"
            problems.append({"loc": ["body", field], "msg": msg, "type": "value_error"})
            continue
        if decision.quality.shortlist and question.kind != "choice":
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
    if decision.quality.shortlist >= len(question.options):
        return question
    options = nearest_options(prior, decision.quality.shortlist)
    residual = float(1 - prior[list(options)].sum())
    shortlists[question.id] = Shortlist(question, options, residual, prior)
    return replace(question, options=tuple(question.options[i] for i in options))


def _prepare(question: Question, decision: Decision, bank: ExampleBank) -> tuple[Question, Shortlist | None]:
    if not decision.quality.shortlist:
        shown = bank.ranking(decision.state, decision.quality.examples)
        return replace(question, examples=bank.solved(shown[::-1])), None
    neighbours = max(decision.quality.examples, SHORTLIST_NEIGHBOURS)
    options = bank.shortlist_options(decision.state, decision.quality.shortlist, neighbours)
    listed = set(options)
    shown = [i for i in bank.ranking(decision.state, len(bank)) if bank.labels[i] in listed][
        : decision.quality.examples
    ]
    read = replace(question, options=tuple(question.options[i] for i in options), examples=bank.solved(shown[::-1]))
    return read, Shortlist(question, options, bank.residual(decision.quality.shortlist, neighbours))


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
