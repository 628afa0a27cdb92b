"""Learned readouts: features, the head's answer, the artifact files and the store."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from slotread.core.aggregate import aggregate_reads
from slotread.core.answers import Answer, Read
from slotread.core.questions import Decision, Option, Question
from slotread.errors import CalibrationError, InvalidRequest
from slotread.models.encoder import SentenceEncoder
from slotread.quality.artifact import schema_hash
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.lexical import bank_classifier, floored
from slotread.quality.readouts.logistic import LogisticHead
from slotread.quality.readouts.readout import Readout, banked_in, read_features
from slotread.quality.readouts.store import ReadoutStore

QUESTION = Question("q", "choice", "Which?", (Option("a"), Option("b")))
SCHEMA = schema_hash(QUESTION, None)


def identity_readout(features: str = "logits", temperature: float = 2.0, **fields: object) -> Readout:
    """A head whose scores are its features' last two columns (the label log-probabilities)."""
    hidden = 3 if features == "hidden+logits" else 0
    weight = np.hstack([np.zeros((2, hidden)), np.eye(2)])
    head = LogisticHead(np.zeros(hidden + 2), np.ones(hidden + 2), weight, np.zeros(2))
    values: dict[str, object] = dict(
        model="m",
        schema=SCHEMA,
        kind="choice",
        options=("a", "b"),
        features=features,
        hidden_size=hidden or None,
        layout="state_first",
        head=head,
        temperature=temperature,
        l2=0.01,
    )
    return Readout(**{**values, **fields})  # type: ignore[arg-type]


def test_features_by_hand() -> None:
    # label logits [0, ln 3] -> log-probabilities [ln 0.25, ln 0.75], after the hidden state
    logits = np.array([[0.0, math.log(3.0)]])
    assert read_features(logits, None, "logits") == pytest.approx(np.array([[math.log(0.25), math.log(0.75)]]))
    both = read_features(logits + 7.0, np.array([[1.0, 2.0]]), "hidden+logits")  # a constant shift changes nothing
    assert both == pytest.approx(np.array([[1.0, 2.0, math.log(0.25), math.log(0.75)]]))


def test_the_head_answers_by_hand() -> None:
    # scores log p = [ln .25, ln .75] at T = 2: softmax(log p / 2) ∝ sqrt(p) = [0.5, 0.866] -> [0.366, 0.634]
    readout = identity_readout()
    p = readout.probabilities(np.array([[0.0, math.log(3.0)]]), None)
    assert p[0] == pytest.approx([0.5 / (0.5 + math.sqrt(0.75)), math.sqrt(0.75) / (0.5 + math.sqrt(0.75))])
    # an answer is the mean over its reads (draws) of the head's distributions
    reads = (Read(0, np.array([0.0, math.log(3.0)]), 1.0), Read(0, np.array([0.0, 0.0]), 1.0))
    raw = Answer(QUESTION, aggregate_reads(np.array([[0.25, 0.75], [0.5, 0.5]])), reads)
    answered = readout.answer(raw)
    assert answered.probabilities == pytest.approx((p[0] + np.array([0.5, 0.5])) / 2)
    assert answered.reads == reads


def test_a_hidden_readout_needs_hidden_states_of_its_size() -> None:
    readout = identity_readout("hidden+logits")
    ok = Read(0, np.array([0.0, 0.0]), 1.0, np.ones(3, dtype=np.float32))
    assert readout.answer(Answer(QUESTION, aggregate_reads(np.array([[0.5, 0.5]])), (ok,))).probabilities == (
        pytest.approx([0.5, 0.5])
    )
    for hidden in (None, np.ones(4)):
        read = Read(0, np.array([0.0, 0.0]), 1.0, hidden)
        with pytest.raises(ValueError, match="hidden states of size 3"):
            readout.answer(Answer(QUESTION, aggregate_reads(np.array([[0.5, 0.5]])), (read,)))


def test_the_artifact_round_trips_and_the_store_keys_it_by_model_and_schema(tmp_path: Path) -> None:
    readout = identity_readout("hidden+logits", fitted_on={"items": 4})
    path = readout.save(tmp_path)
    assert path.name == f"m.{SCHEMA[:16]}.readout.json" and (tmp_path / f"m.{SCHEMA[:16]}.readout.npz").is_file()
    loaded = Readout.load(path)
    assert (loaded.model, loaded.schema, loaded.options, loaded.features) == ("m", SCHEMA, ("a", "b"), "hidden+logits")
    assert loaded.hidden_size == 3 and loaded.temperature == 2.0 and loaded.fitted_on == {"items": 4}
    assert np.array_equal(loaded.head.weight, readout.head.weight)
    identity_readout(model="other").save(tmp_path)  # another model's: skipped

    store = ReadoutStore("m", tmp_path)
    assert store.get(SCHEMA) is not None and store.problem("q", SCHEMA, banked=False) is None
    assert store.layout_for(Decision("s", (QUESTION,), readout=True)) == "state_first"
    missing = store.problem("q", "f" * 64, banked=True)
    assert missing is not None and "no readout is loaded for question 'q' on m" in missing and "slotread fit" in missing
    remote = ReadoutStore("m", tmp_path, hidden_states=False).problem("q", SCHEMA, banked=False)
    assert remote is not None and "--features logits" in remote
    assert not banked_in(tmp_path)


def test_a_readout_with_a_vote_adds_its_weighted_log_and_needs_a_bank(tmp_path: Path) -> None:
    readout = identity_readout(temperature=1.0, vote_neighbours=24, vote_weight=2.0)
    # scores log p = [ln .25, ln .75], plus 2 · log v with v = [.75, .25]: ∝ [.25 · .5625, .75 · .0625]
    logits = np.array([[0.0, math.log(3.0)]])
    expected = np.array([0.25 * 0.5625, 0.75 * 0.0625])
    assert readout.probabilities(logits, None, np.array([0.75, 0.25]))[0] == pytest.approx(expected / expected.sum())
    with pytest.raises(ValueError, match="the vote of 24 bank examples"):
        readout.probabilities(logits, None)
    path = readout.save(tmp_path)
    assert json.loads(path.read_text())["vote"] == {"neighbours": 24, "weight": 2.0}  # BM25: as before
    loaded = Readout.load(path)
    assert (loaded.vote_neighbours, loaded.vote_weight) == (24, 2.0) and banked_in(tmp_path)
    store = ReadoutStore("m", tmp_path)
    assert store.problem("q", SCHEMA, banked=True) is None
    unbanked = store.problem("q", SCHEMA, banked=False)
    assert unbanked is not None and "24 nearest example-bank examples" in unbanked and "--example-bank" in unbanked


def test_a_readout_with_a_lexical_partner_adds_both_logs_by_hand() -> None:
    readout = identity_readout(
        temperature=2.0, vote_neighbours=3, vote_weight=1.0, lexical_weight=0.5, lexical_examples=9
    )
    # scores log p = [ln .25, ln .75] at T = 2 -> [.5, √.75]; times v = [.5, .5]; times q̃^0.5 = [.8, .2]^0.5
    logits = np.array([[0.0, math.log(3.0)]])
    expected = np.array([0.5 * 0.5 * math.sqrt(0.8), math.sqrt(0.75) * 0.5 * math.sqrt(0.2)])
    p = readout.probabilities(logits, None, np.array([0.5, 0.5]), np.array([0.8, 0.2]))
    assert p[0] == pytest.approx(expected / expected.sum())
    with pytest.raises(ValueError, match="lexical classifier"):
        readout.probabilities(logits, None, np.array([0.5, 0.5]))


BANK_PAIRS = [("refund my money", "a"), ("money back please", "a"), ("refund it", "a"), ("my card broke", "b")]
BANK_PAIRS += [("lost card", "b"), ("card missing", "b")]


def test_the_lexical_artifact_round_trips_and_old_artifacts_still_load(tmp_path: Path) -> None:
    path = identity_readout(lexical_weight=0.75, lexical_examples=6).save(tmp_path)
    data = json.loads(path.read_text())
    assert data["lexical"] == {"weight": 0.75, "examples": 6} and data["vote"] is None
    loaded = Readout.load(path)
    assert (loaded.lexical_weight, loaded.lexical_examples, loaded.banked) == (0.75, 6, True) and banked_in(tmp_path)
    del data["lexical"]  # an artifact written before the lexical partner existed
    path.write_text(json.dumps(data))
    old = Readout.load(path)
    assert (old.lexical_weight, old.lexical_examples, old.banked) == (None, 0, False) and not banked_in(tmp_path)
    path.write_text(json.dumps({**data, "lexical": {"weight": -1.0, "examples": 6}}))
    with pytest.raises(CalibrationError, match="lexical weight must not be negative"):
        Readout.load(path)


def test_the_store_fits_the_lexical_classifier_on_the_served_bank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identity_readout(lexical_weight=0.75, lexical_examples=6).save(tmp_path)
    bank = ExampleBank.from_pairs(QUESTION, None, BANK_PAIRS, "bank")
    unbanked = ReadoutStore("m", tmp_path).problem("q", SCHEMA, banked=False)
    assert unbanked is not None and "a text classifier trained on its example bank" in unbanked
    assert "--example-bank" in unbanked
    unfitted = ReadoutStore("m", tmp_path).problem("q", SCHEMA, banked=True)
    assert unfitted is not None and "loaded without its bank" in unfitted

    with caplog.at_level("INFO", logger="slotread.quality.readouts.store"):
        store = ReadoutStore("m", tmp_path, banks=ExampleBanks([bank]))
    assert store.problem("q", SCHEMA, banked=True) is None
    assert "fitted on 6 examples of bank in" in caplog.text and "WARNING" not in caplog.text
    expected = floored(bank_classifier(bank).probabilities(["refund please"]))[0]
    assert store.lexical(SCHEMA, "refund please") == pytest.approx(expected, abs=1e-12)
    assert expected.sum() == pytest.approx(1.0) and expected[0] > 0.5  # the refund texts are option a's

    smaller = ExampleBank.from_pairs(QUESTION, None, BANK_PAIRS[1:], "smaller bank")
    caplog.clear()
    ReadoutStore("m", tmp_path, banks=ExampleBanks([smaller]))
    assert "fitted with a bank of 6 examples; smaller bank serves 5" in caplog.text


def test_broken_or_duplicate_artifacts_are_refused(tmp_path: Path) -> None:
    path = identity_readout().save(tmp_path)
    data = json.loads(path.read_text())
    (tmp_path / "copy.readout.json").write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="are both readouts of schema"):
        ReadoutStore("m", tmp_path)
    (tmp_path / "copy.readout.json").write_text(json.dumps({**data, "temperature": -1}))
    with pytest.raises(CalibrationError, match=r"copy\.readout\.json: not a readable"):
        ReadoutStore("m", tmp_path)


def test_readouts_fitted_in_two_layouts_cannot_answer_one_decision(tmp_path: Path) -> None:
    other = Question("r", "choice", "Which one?", (Option("a"), Option("b")))
    identity_readout().save(tmp_path)
    identity_readout(schema=schema_hash(other, None), layout="schema_first").save(tmp_path)
    with pytest.raises(InvalidRequest, match="different prompt layouts"):
        ReadoutStore("m", tmp_path).layout_for(Decision("s", (QUESTION, other), readout=True))


def test_a_readout_serves_its_vote_only_under_the_retrieval_it_was_fitted_with(
    tmp_path: Path, encoder: SentenceEncoder
) -> None:
    path = identity_readout(vote_neighbours=3, vote_weight=1.0, vote_retrieval="dense").save(tmp_path)
    data = json.loads(path.read_text())
    assert data["vote"] == {"neighbours": 3, "weight": 1.0, "retrieval": "dense"}
    assert Readout.load(path).vote_retrieval == "dense"
    bank = ExampleBank.from_pairs(QUESTION, None, BANK_PAIRS, "bank")
    under_bm25 = ReadoutStore("m", tmp_path, banks=ExampleBanks([bank])).problem("q", SCHEMA, banked=True)
    assert under_bm25 is not None and "ranks them by bm25: serve it with --retrieval dense" in under_bm25
    dense = ExampleBanks([bank], "dense", encoder.embed)
    assert ReadoutStore("m", tmp_path, banks=dense).problem("q", SCHEMA, banked=True) is None
    # artifacts written before retrieval was recorded voted by BM25, and serve only under it
    path.write_text(json.dumps({**data, "vote": {"neighbours": 3, "weight": 1.0}}))
    assert Readout.load(path).vote_retrieval == "bm25"
    assert ReadoutStore("m", tmp_path, banks=ExampleBanks([bank])).problem("q", SCHEMA, banked=True) is None
    assert ReadoutStore("m", tmp_path, banks=dense).problem("q", SCHEMA, banked=True) is not None
    path.write_text(json.dumps({**data, "vote": {"neighbours": 3, "weight": 1.0, "retrieval": "tfidf"}}))
    with pytest.raises(CalibrationError, match="retrieval must be one of bm25, dense, hybrid"):
        Readout.load(path)
