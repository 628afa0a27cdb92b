"""Example banks: the neighbour vote, shortlists and their residual mass, worked out by hand."""

import numpy as np
import pytest

from slotread.core.aggregate import ReadSummary, softmax
from slotread.core.answers import Answer, Read
from slotread.core.questions import Decision, Option, QualityOptions, Question
from slotread.errors import ExampleBankError, InvalidRequest
from slotread.prompt.render import SolvedExample
from slotread.quality.examples.bank import VOTE_TIE_BREAK, ExampleBank, ExampleBanks, residual_mass, vote_distribution
from slotread.quality.examples.shortlist import Shortlist, expand_answer, expand_probabilities, retrieve

TOPICS = Question(
    "topic", "choice", "Which topic?", tuple(Option(n) for n in ("card", "refund", "pin", "rate", "other"))
)
EXAMPLES = [
    SolvedExample("where is my new card", "card"),
    SolvedExample("my card has not arrived", "card"),
    SolvedExample("card delivery is late", "card"),
    SolvedExample("i want my money back", "refund"),
    SolvedExample("refund my card payment", "refund"),
    SolvedExample("my pin is blocked", "pin"),
]


def bank() -> ExampleBank:
    return ExampleBank(TOPICS, None, EXAMPLES, "test bank")


def test_the_vote_by_hand() -> None:
    # two neighbours say 0, one says 2; c = 1 spread over n = 4 options: (v + 1/4) / (W + 1)
    p = vote_distribution([0, 2, 0], 4)
    weights = 1 + VOTE_TIE_BREAK * np.array([3, 2, 1]) / 3
    total = weights.sum() + 1
    expected = [(weights[0] + weights[2] + 0.25) / total, 0.25 / total, (weights[1] + 0.25) / total, 0.25 / total]
    assert p == pytest.approx(expected)
    assert p.sum() == pytest.approx(1.0)
    # a tie goes to the label of the nearer neighbour
    assert vote_distribution([3, 1], 4).argmax() == 3
    assert vote_distribution([], 4) == pytest.approx([0.25] * 4)


def test_residual_mass_is_laplace_smoothed() -> None:
    assert residual_mass(0, 8) == pytest.approx(0.1)
    assert residual_mass(3, 98) == pytest.approx(0.04)


def test_expanded_probabilities_give_the_residual_to_the_options_off_the_list() -> None:
    p = expand_probabilities(np.array([0.75, 0.25]), (1, 3), 5, 0.3)
    assert p == pytest.approx([0.1, 0.7 * 0.75, 0.1, 0.7 * 0.25, 0.1])
    assert expand_probabilities(np.array([0.6, 0.4]), (0, 1), 2, 0.3) == pytest.approx([0.6, 0.4])


def test_a_bank_ranks_votes_and_shortlists() -> None:
    examples = bank()
    # "refund my card payment" shares "my" and "card" and is shorter than "where is my new card"
    assert examples.ranking("my card never arrived", 2) == [1, 4]
    assert examples.vote("my card never arrived", 3).argmax() == 0
    # the 3 nearest of "refund my card" are 4 (refund), then the card examples: two labels voted
    assert examples.shortlist_options("refund my card", 4, 3) == (0, 1)
    # at most `size` options, by vote: card (2 votes) beats refund (1)
    assert examples.shortlist_options("my card refund", 1, 3) == (0,)
    # one label among the neighbours: the next examples are walked until a second label turns up
    assert len(examples.shortlist_options("card card", 3, 1)) == 2


def test_a_left_out_vote_skips_the_examples_asked_about() -> None:
    repeated = ExampleBank(TOPICS, None, [*EXAMPLES, SolvedExample("my pin is blocked", "pin")], "repeats")
    # asked about itself, the pin example (held twice) is its own nearest neighbour, twice
    assert repeated.vote("my pin is blocked", 2).argmax() == 2
    alone = repeated.vote("my pin is blocked", 2, leave_out=True)
    # left out: the next two are the "my ... card" examples, none a pin
    assert alone == pytest.approx(vote_distribution(repeated.labels[[1, 0]], 5))
    assert alone[2] == pytest.approx(1 / 5 / (2 + 2 * VOTE_TIE_BREAK * 0.75 + 1))


def test_the_residual_is_the_leave_one_out_miss_rate() -> None:
    examples = bank()
    # leave-one-out shortlists of one option from the single nearest other example
    misses = sum(
        int(examples.labels[i]) not in examples.shortlist_options(e.state, 1, 1, exclude=i)
        for i, e in enumerate(EXAMPLES)
    )
    assert misses >= 2  # "i want my money back" and "my pin is blocked" have no neighbour of their label
    assert examples.residual(1, 1) == pytest.approx((misses + 1) / (len(EXAMPLES) + 2))


def test_a_bank_refuses_answers_its_question_lacks() -> None:
    with pytest.raises(ExampleBankError, match="'lost' is not an option"):
        ExampleBank(TOPICS, None, [SolvedExample("x", "lost")], "bad bank")
    with pytest.raises(ExampleBankError, match="same question schema"):
        ExampleBanks([bank(), bank()])


def test_retrieve_shows_the_nearest_examples_last_and_shortlists() -> None:
    banks = ExampleBanks([bank()])
    decision = Decision("my card has not come", (TOPICS,), quality=QualityOptions(examples=2))
    shown, shortlists = retrieve(decision, banks)
    assert shortlists == {}
    assert [e.state for e in shown.questions[0].examples] == ["refund my card payment", "my card has not arrived"]
    shown, shortlists = retrieve(
        Decision("refund my card", (TOPICS,), quality=QualityOptions(examples=6, shortlist=2)), banks
    )
    (question,) = shown.questions
    assert [o.name for o in question.options] == ["card", "refund"]
    # only examples answerable in the shortlist are shown: not the pin one
    assert {e.answer for e in question.examples} == {"card", "refund"} and len(question.examples) == 5
    assert shortlists["topic"].options == (0, 1) and 0 < shortlists["topic"].residual < 1


def test_retrieve_refuses_questions_no_bank_serves_and_shortlists_of_nouls() -> None:
    other = Question("other", "choice", "Which topic?", (Option("a"), Option("b")))
    urgent = Question("urgent", "noul", None, (Option("yes"), Option("no")))
    banks = ExampleBanks([bank(), ExampleBank(urgent, None, [SolvedExample("now!", "yes")], "nouls")])
    with pytest.raises(InvalidRequest) as found:
        retrieve(Decision("x", (TOPICS, other), quality=QualityOptions(examples=1)), banks)
    assert found.value.detail[0]["loc"] == ["body", "x_examples"] and "'other'" in found.value.detail[0]["msg"]
    with pytest.raises(InvalidRequest, match="is a noul"):
        retrieve(Decision("x", (urgent,), quality=QualityOptions(shortlist=2)), banks)


def test_an_expanded_answer_covers_every_option_and_sums_to_one() -> None:
    read_question = Question("topic", "choice", "Which topic?", (Option("card"), Option("pin")))
    reads = (Read(0, np.array([2.0, 0.0]), 0.9), Read(1, np.array([1.0, 0.0]), 0.8))
    per_read = softmax(np.stack([r.logits for r in reads]))
    mean = per_read.mean(axis=0)
    stderr = per_read.std(axis=0, ddof=1) / np.sqrt(2)
    answer = Answer(read_question, ReadSummary(mean, stderr, 1.0, 0.5, 2), reads)
    expanded = expand_answer(answer, Shortlist(TOPICS, (0, 2), 0.25))
    p = expanded.probabilities
    assert p.sum() == pytest.approx(1.0) and expanded.question is TOPICS
    assert p[[1, 3, 4]] == pytest.approx([0.25 / 3] * 3)
    assert p[[0, 2]] == pytest.approx(0.75 * mean)
    assert expanded.summary.stderr is not None and expanded.summary.stderr[[1, 3, 4]] == pytest.approx([0, 0, 0])
    # every read agrees with the summary: the mean of the reads' distributions is the answer
    assert softmax(np.stack([r.logits for r in expanded.reads])).mean(axis=0) == pytest.approx(p)
    assert expanded.top_name == "card" and expanded.label_mass == pytest.approx(0.85)
