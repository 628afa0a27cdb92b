"""Bank retrieval by words, meaning or both, with the real all-MiniLM-L6-v2 (its PyPI wheel)."""

import numpy as np
import pytest

from slotread.core.questions import Decision, Option, QualityOptions, Question
from slotread.errors import ExampleBankError, SettingsError
from slotread.models.encoder import SentenceEncoder
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.bm25 import BM25
from slotread.quality.examples.retrieval import RRF_K, Retriever
from slotread.quality.examples.shortlist import retrieve
from slotread.settings import DeciderSettings, EvalSettings, FitSettings

TOPICS = Question(
    "topic", "choice", "Which topic?", tuple(Option(n) for n in ("card", "refund", "pin", "rate", "other"))
)
PAIRS = [
    ("where is my new card", "card"),
    ("i want my money back", "refund"),
    ("my pin is blocked", "pin"),
    ("the exchange rate is bad", "rate"),
    ("my card has not arrived", "card"),
    ("the pin on my card does not work", "pin"),
]
#: shares no word with any example: BM25 scores every example 0 and ranks them in bank order
PARAPHRASE = "could you reimburse me"
#: shares only "the" with the rate and pin examples, none with the refund one
PARAPHRASE_THE = "could you reimburse the purchase"


def bank(retrieval: str = "bm25", encoder: SentenceEncoder | None = None) -> ExampleBank:
    embed = encoder.embed if encoder is not None else None
    return ExampleBank.from_pairs(TOPICS, None, PAIRS, "bank", retrieval=retrieval, embed=embed)  # type: ignore[arg-type]


def test_a_paraphrase_with_no_shared_word_is_found_by_meaning_not_by_words(encoder: SentenceEncoder) -> None:
    words, dense, hybrid = bank(), bank("dense", encoder), bank("hybrid", encoder)
    assert words.ranking(PARAPHRASE, 1) == [0]  # a tie of zeros: the first example
    assert dense.ranking(PARAPHRASE, 1) == [1] and hybrid.ranking(PARAPHRASE, 1) == [1]
    assert dense.vote(PARAPHRASE, 1).argmax() == 1 and words.vote(PARAPHRASE, 1).argmax() == 0
    # a word shared with wrong examples: BM25 keeps them first; the fusion keeps its own word match first,
    # then the paraphrase above every example that matches neither way
    assert 1 not in words.ranking(PARAPHRASE_THE, 3)
    assert dense.ranking(PARAPHRASE_THE, 1) == [1]
    assert hybrid.ranking(PARAPHRASE_THE, 3).index(1) < 3
    # the shortlist and the shown examples of x_examples follow the bank's retrieval
    decision = Decision(PARAPHRASE, (TOPICS,), quality=QualityOptions(examples=1))
    assert (
        retrieve(decision, ExampleBanks([dense], "dense", encoder.embed))[0].questions[0].examples[0].answer == "refund"
    )
    assert retrieve(decision, ExampleBanks([words]))[0].questions[0].examples[0].answer == "card"


def test_dense_ranks_by_cosine_and_hybrid_by_reciprocal_ranks(encoder: SentenceEncoder) -> None:
    states = [state for state, _ in PAIRS]
    query = "card pin not working"
    cosines = encoder.embed(states) @ encoder.embed([query])[0]
    assert Retriever(states, "dense", encoder.embed).top(query, 6) == sorted(range(6), key=lambda i: -cosines[i])
    # the fused score, written out: BM25 places only for examples sharing a word, dense places for all
    words = BM25(states).scores(query)
    word_place = {i: p + 1 for p, i in enumerate(sorted(range(6), key=lambda i: (-words[i], i)))}
    dense_place = {i: p + 1 for p, i in enumerate(sorted(range(6), key=lambda i: (-cosines[i], i)))}
    score = {i: (1 / (RRF_K + word_place[i]) if words[i] > 0 else 0) + 1 / (RRF_K + dense_place[i]) for i in range(6)}
    expected = sorted(range(6), key=lambda i: (-score[i], i))
    hybrid = Retriever(states, "hybrid", encoder.embed)
    assert hybrid.top(query, 6) == expected
    assert hybrid.scores(query) == pytest.approx([score[i] for i in range(6)])
    assert words[3] == 0 and score[3] == 1 / (RRF_K + dense_place[3])  # the rate example shares no word
    assert len(set(word_place.values())) == 6 and words[0] > 0
    # leaving an example out ranks the others as if it were not there
    out = expected[0]
    assert hybrid.top(query, 5, exclude=out) == [i for i in expected if i != out]


def test_leave_one_out_votes_and_residuals_work_under_every_retrieval(encoder: SentenceEncoder) -> None:
    for retrieval in ("dense", "hybrid"):
        examples = bank(retrieval, encoder)
        assert 0 not in examples.ranking(PAIRS[0][0], 6, exclude=0)
        assert examples.vote(PAIRS[2][0], 1, leave_out=True).argmax() == 2  # the other pin example
        assert 0 < examples.residual(2, 2) < 1


def test_dense_and_hybrid_need_an_encoder_and_say_which_flag() -> None:
    for retrieval in ("dense", "hybrid"):
        with pytest.raises(ExampleBankError, match=f"--retrieval {retrieval}.*--encoder"):
            bank(retrieval)
        with pytest.raises(ExampleBankError, match=f"--retrieval {retrieval}.*--encoder"):
            ExampleBanks([bank()], retrieval)  # type: ignore[arg-type]
        with pytest.raises(SettingsError, match=f"--retrieval {retrieval}.*--encoder"):
            DeciderSettings(retrieval=retrieval)  # type: ignore[arg-type]
        with pytest.raises(SettingsError, match=f"--retrieval {retrieval}.*--encoder"):
            EvalSettings(dataset="banking77", out="x", baseline="knn", examples=3, retrieval=retrieval)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="TF-IDF baseline reads no bank"):
        EvalSettings(dataset="banking77", out="x", baseline="tfidf", retrieval="dense", encoder="all-minilm-l6-v2")
    with pytest.raises(SettingsError, match="give --vote K"):
        FitSettings(dataset="banking77", out="x", retrieval="hybrid", encoder="all-minilm-l6-v2")
    assert DeciderSettings().retrieval == "bm25" and ExampleBanks([bank()]).retrieval == "bm25"


def test_served_banks_are_reranked_once_and_embedded_once(encoder: SentenceEncoder) -> None:
    words = bank()
    assert ExampleBanks([words]).get(words.schema) is words  # same retrieval: the bank itself
    served = ExampleBanks([words], "hybrid", encoder.embed).get(words.schema)
    assert served is not None and served is not words and served.retrieval == "hybrid"
    assert served.retrieving("hybrid", encoder.embed) is served
    calls: list[int] = []

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        return encoder.embed(texts)

    counted = bank().retrieving("dense", counting)
    counted.ranking("my card", 2)
    counted.ranking("my pin", 2)
    assert calls == [len(PAIRS), 1, 1]  # the bank's states once, then one query each
