"""Shortlists from meaning: all-MiniLM-L6-v2 ranks a choice's options, no example bank needed."""

import numpy as np
import pytest

from slotread.core.questions import Decision, Option, QualityOptions, Question
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.models.encoder import SentenceEncoder
from slotread.models.load import LoadedModel
from slotread.quality.examples.bank import ExampleBanks
from slotread.quality.examples.meaning import (
    POOL_EXPONENT,
    SIMILARITY_TEMPERATURE,
    fit_pool_exponent,
    nearest_options,
    option_text,
    pool,
    pool_log_likelihood,
    read_from_pool,
    similarity_distribution,
)
from slotread.quality.examples.shortlist import expand_probabilities, retrieve

TOPICS = Question(
    "topic",
    "choice",
    "Which topic?",
    (
        Option("card arrival", "a new card has not come yet"),
        Option("request refund"),
        Option("exchange rate"),
        Option("lost or stolen card"),
        Option("top up failed"),
    ),
)
STATE = "I would like my money back for this purchase"


def test_the_similarity_distribution_is_the_tempered_softmax_of_cosines(encoder: SentenceEncoder) -> None:
    q = similarity_distribution(TOPICS, STATE, encoder.embed)
    vectors = encoder.embed([STATE, *(option_text(TOPICS, i) for i in range(5))]).astype(np.float64)
    cosine = vectors[1:] @ vectors[0] / np.linalg.norm(vectors[1:], axis=1) / np.linalg.norm(vectors[0])
    expected = np.exp(cosine / SIMILARITY_TEMPERATURE) / np.exp(cosine / SIMILARITY_TEMPERATURE).sum()
    np.testing.assert_allclose(q, expected, rtol=1e-5)
    assert q.argmax() == 1 and option_text(TOPICS, 0) == "card arrival: a new card has not come yet"
    assert nearest_options(np.array([0.1, 0.4, 0.1, 0.3, 0.1]), 3) == (0, 1, 3)  # ties to the earlier option


def test_the_list_shares_its_mass_as_the_pool_of_read_and_encoder() -> None:
    q = np.array([0.5, 0.2, 0.2, 0.1])
    full = expand_probabilities(np.array([0.1, 0.9]), (0, 2), 4, 0.3, q)
    pooled = np.array([0.1 * 0.5, 0.9 * 0.2]) ** POOL_EXPONENT
    assert full == pytest.approx([0.7 * pooled[0] / pooled.sum(), 0.2, 0.7 * pooled[1] / pooled.sum(), 0.1])
    assert full.sum() == pytest.approx(1.0)
    # by hand, w = 0.7: 0.05^0.7 = 0.122823, 0.18^0.7 = 0.301086; the list keeps Q_S = 0.7, the rest keep q
    assert pool(np.array([0.1, 0.9]), q, (0, 2), 0.7) == pytest.approx([0.202817, 0.2, 0.497183, 0.1], abs=1e-6)
    assert pool(np.array([0.1, 0.9]), q, (0, 2), 0.5) == pytest.approx(  # w = ½: the geometric mean
        [
            0.7 * np.sqrt(0.05) / (np.sqrt(0.05) + np.sqrt(0.18)),
            0.2,
            0.7 * np.sqrt(0.18) / (np.sqrt(0.05) + np.sqrt(0.18)),
            0.1,
        ]
    )


def test_a_read_is_recovered_exactly_from_its_pooled_answer() -> None:
    generator = np.random.default_rng(0)
    q = generator.dirichlet(np.ones(12))
    read = generator.dirichlet(np.ones(4) * 0.3)
    for w in (0.5, POOL_EXPONENT, 1.3):
        answer = pool(read, q, (1, 4, 5, 9), w)
        np.testing.assert_allclose(read_from_pool(answer, q, (1, 4, 5, 9), w), read, rtol=1e-9)
        np.testing.assert_allclose(np.delete(answer, [1, 4, 5, 9]), np.delete(q, [1, 4, 5, 9]))


def test_the_pool_exponent_fit_finds_the_exponent_the_answers_came_from() -> None:
    generator = np.random.default_rng(0)
    scores = generator.normal(0, 3, size=(4000, 10))  # log(p_read · q) on each item's list
    gold = np.array([generator.choice(10, p=np.exp(0.7 * z) / np.exp(0.7 * z).sum()) for z in scores])
    w = fit_pool_exponent(scores, gold)
    assert w == pytest.approx(0.7, abs=0.05)
    direct = sum(np.log(np.exp(w * z[g]) / np.exp(w * z).sum()) for z, g in zip(scores, gold, strict=True))
    assert pool_log_likelihood(w, scores, gold) == pytest.approx(direct)
    grid = np.linspace(0.05, 2.0, 40)  # the search's answer beats every point of a grid over its range
    assert pool_log_likelihood(w, scores, gold) >= max(pool_log_likelihood(v, scores, gold) for v in grid) - 1e-6


def test_retrieve_shortlists_by_meaning_without_a_bank(encoder: SentenceEncoder) -> None:
    decision = Decision(STATE, (TOPICS,), quality=QualityOptions(shortlist=2))
    read, shortlists = retrieve(decision, ExampleBanks(), encoder.embed)
    (question,) = read.questions
    shortlist = shortlists["topic"]
    assert 1 in shortlist.options and len(question.options) == 2
    assert shortlist.prior is not None
    assert shortlist.residual == pytest.approx(1 - shortlist.prior[list(shortlist.options)].sum())
    with pytest.raises(InvalidRequest, match="--encoder"):
        retrieve(decision, ExampleBanks())
    with pytest.raises(InvalidRequest, match="no example bank"):  # examples need a bank, meaning or not
        retrieve(
            Decision(STATE, (TOPICS,), quality=QualityOptions(shortlist=2, examples=1)), ExampleBanks(), encoder.embed
        )
    whole, none = retrieve(
        Decision(STATE, (TOPICS,), quality=QualityOptions(shortlist=5)), ExampleBanks(), encoder.embed
    )
    assert whole.questions == (TOPICS,) and none == {}  # a list as long as the options: read them all


def test_a_decider_with_an_encoder_answers_every_option(smollm2: LoadedModel, encoder: SentenceEncoder) -> None:
    decider = Decider(smollm2, encoder=encoder)
    criteria = {option.name: option.description for option in TOPICS.options}
    request = {
        "state": STATE,
        "questions": {"t": {"type": "choice", "instructions": "Which topic?", "criteria": criteria}},
        "x_shortlist": 2,
    }
    p = decider.decide(request)["answers"]["t"]["probabilities"]
    q = similarity_distribution(TOPICS, STATE, encoder.embed)
    listed = nearest_options(q, 2)
    assert sum(p.values()) == pytest.approx(1.0) and min(p.values()) > 0
    for i, option in enumerate(TOPICS.options):
        if i not in listed:
            assert p[option.name] == pytest.approx(q[i])  # an unread option keeps the encoder's belief
    assert sum(p[TOPICS.options[i].name] for i in listed) == pytest.approx(q[list(listed)].sum())
    plain = Decider(smollm2)
    # the list is the pool, at POOL_EXPONENT, of q and the model's own read of the listed options alone
    names = [TOPICS.options[i].name for i in listed]
    alone = {"t": {"type": "choice", "instructions": "Which topic?", "criteria": {n: criteria[n] for n in names}}}
    read = plain.decide({"state": STATE, "questions": alone})["answers"]["t"]["probabilities"]
    expected = pool(np.array([read[n] for n in names]), q, listed, POOL_EXPONENT)
    assert [p[o.name] for o in TOPICS.options] == pytest.approx(expected, rel=1e-4)
    with pytest.raises(InvalidRequest, match="--encoder"):
        plain.decide(request)
