"""Fitting a learned readout on SmolLM2 and answering with it, through the Python API and the command line."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotread.api.systemone import parse_request, to_decision
from slotread.cli import main
from slotread.core.reads import read_each
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.eval.datasets import Dataset, Item, Task
from slotread.models.encoder import SentenceEncoder
from slotread.models.load import LoadedModel
from slotread.quality.artifact import schema_hash
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.dense import bank_embedding_classifier
from slotread.quality.examples.lexical import bank_classifier, floored
from slotread.quality.readouts.fusion import WEIGHT_MAX
from slotread.quality.readouts.readout import Readout
from slotread.quality.readouts.train import fit_readout, holdout_split

QUESTION: dict[str, Any] = {
    "type": "choice",
    "instructions": "What does the customer want?",
    "criteria": {"refund": "money back", "card": "a new or missing card", "other": None},
}
TASK = Task("choice", QUESTION, ("refund", "card", "other"))
TEXTS = [
    ("I want my money back", 0),
    ("Refund my order please", 0),
    ("Give me a refund now", 0),
    ("Return the money for this", 0),
    ("My card never arrived", 1),
    ("I lost my card", 1),
    ("My card is broken, I need a new one", 1),
    ("Where is my new card", 1),
    ("What are your opening hours", 2),
    ("Nice weather today", 2),
    ("Who is your CEO", 2),
    ("Do you sell shoes", 2),
]
DATA = Dataset("train.csv", None, TASK, tuple(Item(str(i), text, gold) for i, (text, gold) in enumerate(TEXTS)))


def body(state: str, **fields: Any) -> dict[str, Any]:
    return {"state": state, "questions": {"answer": QUESTION}, **fields}


def test_the_held_out_split_is_stratified_and_seeded() -> None:
    gold = np.array([item.gold for item in DATA.items])
    train, held = holdout_split(gold, 0.25, seed=0)
    assert sorted(gold[held].tolist()) == [0, 1, 2]  # round(0.25 · 12) = 3 items, one per class
    assert sorted([*train, *held]) == list(range(12))
    assert np.array_equal(holdout_split(gold, 0.25, seed=0)[1], held)


def test_batched_reads_are_the_reads_decide_makes_with_hidden_states(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    decision = to_decision(parse_request(body(TEXTS[0][0], x_readout=True)))
    ((batched,),) = read_each([decision], decider.engine, decider.renderer)
    plain = decider.answer(body(TEXTS[0][0])).answers["answer"]
    assert plain is not None and plain.reads[0].hidden is None
    (read,) = batched.reads
    # the second read finds the state's prefix cached: equal up to the engine's float tolerance
    np.testing.assert_allclose(read.logits, plain.reads[0].logits, atol=1e-4, rtol=0)
    assert read.hidden is not None and read.hidden.shape == (smollm2.model.config.hidden_size,)


def test_a_fitted_readout_answers_x_readout_requests(smollm2: LoadedModel, tmp_path: Path) -> None:
    fit = fit_readout(Decider(smollm2), DATA, per_class=None, holdout=0.25, l2=[0.01, 0.1], progress=False)
    readout = fit.readout
    assert readout.model == smollm2.name and readout.options == ("refund", "card", "other")
    assert readout.schema == schema_hash(to_decision(parse_request(body("x"))).questions[0], None)
    assert readout.layout == "state_first" and readout.features == "hidden+logits" and readout.l2 in (0.01, 0.1)
    assert readout.hidden_size == smollm2.model.config.hidden_size and readout.temperature > 0
    assert fit.metrics["held_out_items"] == 12 and fit.metrics["cross_fitted"] == 1  # 3 held out: too few
    assert fit.metrics["trusted"] == 0 and 0 <= fit.metrics["accuracy"] <= 1 and 0 <= fit.metrics["ece"] <= 1
    assert readout.fitted_on["items"] == 12 and readout.fitted_on["metrics"] == fit.metrics
    readout.save(tmp_path)

    decider = Decider(smollm2, readout_dir=tmp_path)
    answer = decider.answer(body("Please refund me", x_readout=True)).answers["answer"]
    assert answer is not None and len(answer.reads) == 1 and answer.reads[0].hidden is not None
    expected = readout.probabilities(answer.reads[0].logits[None], answer.reads[0].hidden[None])[0]
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)
    response = decider.decide(body("Please refund me", x_readout=True))["answers"]["answer"]
    assert list(response["probabilities"].values()) == pytest.approx(expected, abs=1e-4)  # a cached prefix
    # the plain read is unchanged by the readout being loaded
    plain = decider.answer(body("Please refund me")).answers["answer"]
    assert plain is not None
    np.testing.assert_allclose(plain.reads[0].logits, answer.reads[0].logits, atol=1e-4, rtol=0)


def test_x_readout_without_a_fitted_readout_is_refused(smollm2: LoadedModel, tmp_path: Path) -> None:
    for decider in (Decider(smollm2), Decider(smollm2, readout_dir=tmp_path)):
        with pytest.raises(InvalidRequest) as caught:
            decider.decide(body("hi", x_readout=True))
        (problem,) = caught.value.detail
        assert problem["loc"] == ["body", "x_readout"] and "slotread fit" in problem["msg"]


def write_question_and_train(folder: Path) -> None:
    """The question file ``q.json`` and the labelled ``train.jsonl`` (DATA) the command-line tests read."""
    (folder / "q.json").write_text(json.dumps(QUESTION))
    rows = [{"id": item.id, "text": item.state, "label": TASK.classes[item.gold]} for item in DATA.items]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_overlap_with_the_evaluation_data_is_refused_before_reading(smollm2: LoadedModel) -> None:
    test = Dataset("banking77", "test", TASK, (Item("0", "  i LOST my card ", 1),))
    with pytest.raises(InvalidRequest, match="also appear in banking77 test"):
        fit_readout(Decider(smollm2), DATA, exclude=test)


def test_bad_fit_options_and_too_few_items_are_invalid_requests(smollm2: LoadedModel) -> None:
    decider = Decider(smollm2)
    for options, loc in (({"holdout": 1.0}, "holdout"), ({"vote": -1}, "vote"), ({"holdout": 0.0}, "holdout")):
        with pytest.raises(InvalidRequest) as caught:
            fit_readout(decider, DATA, progress=False, **options)  # type: ignore[arg-type]
        assert [problem["loc"] for problem in caught.value.detail] == [[loc]]
    # one item cannot be cross-fitted: a clear request error (exit 2 from the command), not a traceback
    few = Dataset("few.csv", None, TASK, DATA.items[:1])
    with pytest.raises(InvalidRequest, match="too few to cross-fit"):
        fit_readout(decider, few, per_class=None, progress=False, features="logits")


def test_the_command_fits_and_decide_answers_with_it(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_question_and_train(tmp_path)
    (tmp_path / "test.csv").write_text("text,label\nI lost my card,card\n")
    command = ["--cache-dir", str(cache_dir), "fit", "--model", smollm2.name, "--questions", str(tmp_path / "q.json")]
    command += ["--data", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "readouts"), "--no-progress"]
    command += ["--per-class", "3", "--holdout", "0.34", "--layout", "schema_first"]
    for bad in (["--vote", "-1"], ["--holdout", "1"]):
        assert main([*command, *bad]) == 1
        assert "--vote must not be negative" in capsys.readouterr().err
    assert main([*command, "--exclude", str(tmp_path / "test.csv")]) == 2
    assert "also appear in" in capsys.readouterr().err and not (tmp_path / "readouts").exists()
    assert main(command) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert (
        "9 items (9 held out, 0 overlapping dropped), schema_first" in out
        and "held out (cross-fitted): accuracy" in out
        and "wrote" in out
    )
    assert "the held-out figures rest on 9 items (fewer than 300)" in captured.err
    (path,) = (tmp_path / "readouts").glob("*.readout.json")
    assert Readout.load(path).layout == "schema_first"

    (tmp_path / "request.json").write_text(json.dumps(body("Refund please", x_readout=True)))
    decide = ["--cache-dir", str(cache_dir), "decide", str(tmp_path / "request.json"), "--model", smollm2.name]
    assert main([*decide, "--readout", str(tmp_path / "readouts")]) == 0
    answer = json.loads(capsys.readouterr().out)["answers"]["answer"]
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0)
    assert main(decide) == 2
    assert "x_readout" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny_diffusion", "tiny_bert"])
def test_readouts_fit_and_answer_on_the_diffusion_and_masked_families(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Random weights: the numbers mean nothing, the plumbing (draws, hidden sizes, layouts) is checked."""
    loaded: LoadedModel = request.getfixturevalue(name)
    samples = {"x_samples": 2}
    fit = fit_readout(Decider(loaded), DATA, per_class=None, holdout=0.25, request_fields=samples, progress=False)
    fit.readout.save(tmp_path)
    decider = Decider(loaded, readout_dir=tmp_path)
    answer = decider.answer(body("Please refund me", x_readout=True, **samples)).answers["answer"]
    assert answer is not None
    draws = 2 if decider.engine.noisy else 1
    assert len(answer.reads) == draws and fit.readout.fitted_on["request"]["x_samples"] == 2
    logits = np.stack([read.logits for read in answer.reads])
    hidden = np.stack([read.hidden for read in answer.reads if read.hidden is not None])
    assert hidden.shape == (draws, fit.readout.hidden_size)
    expected = fit.readout.probabilities(logits, hidden).mean(axis=0)  # the mean over the draws
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)


def test_a_readout_with_a_vote_answers_with_its_bank_and_eval_builds_the_bank(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit = fit_readout(Decider(smollm2), DATA, per_class=None, holdout=0.25, l2=[0.1], vote=3, progress=False)
    readout = fit.readout
    assert readout.vote_neighbours == 3 and 0 <= readout.vote_weight <= 5
    assert {"head_accuracy", "vote_accuracy"} <= fit.metrics.keys()
    readout.save(tmp_path / "readouts")

    question = to_decision(parse_request(body("x"))).questions[0]
    bank = ExampleBank.from_pairs(question, None, [(text, TASK.classes[gold]) for text, gold in TEXTS], "bank")
    with pytest.raises(InvalidRequest, match="--example-bank"):
        Decider(smollm2, readout_dir=tmp_path / "readouts").decide(body("Refund please", x_readout=True))
    decider = Decider(smollm2, readout_dir=tmp_path / "readouts", example_banks=[bank])
    answer = decider.answer(body("Refund please", x_readout=True)).answers["answer"]
    assert answer is not None and answer.reads[0].hidden is not None
    (read,) = answer.reads
    expected = readout.probabilities(read.logits[None], read.hidden[None], bank.vote("Refund please", 3))[0]
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)

    # slotread eval builds the vote's bank from the train file, without the evaluated texts
    write_question_and_train(tmp_path)
    (tmp_path / "test.csv").write_text("text,label\nI lost my card,card\nRefund please,refund\n")
    command = ["--cache-dir", str(cache_dir), "eval", "--model", smollm2.name, "--question", str(tmp_path / "q.json")]
    command += ["--dataset", str(tmp_path / "test.csv"), "--train", str(tmp_path / "train.jsonl"), "--no-progress"]
    assert main([*command, "--readout", str(tmp_path / "readouts"), "--out", str(tmp_path / "run")]) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "without the 1 texts" in run["example_bank"]["source"] and run["example_bank"]["examples"] == 11


def test_a_lexical_readout_fits_from_the_command_and_answers_with_its_bank(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_question_and_train(tmp_path)
    command = ["--cache-dir", str(cache_dir), "fit", "--model", smollm2.name, "--questions", str(tmp_path / "q.json")]
    command += ["--data", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "readouts"), "--per-class", "0"]
    command += ["--holdout", "0.25", "--l2", "0.1", "--vote", "3", "--lexical", "--no-progress"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "head alone" in out and "vote alone" in out and "lexical alone" in out
    assert "cross-fitting the lexical classifier" in out and "; lexical " in out
    (path,) = (tmp_path / "readouts").glob("*.readout.json")
    readout = Readout.load(path)
    assert readout.lexical_weight is not None and 0 <= readout.lexical_weight <= WEIGHT_MAX
    assert readout.lexical_examples == 12 and readout.vote_neighbours == 3
    assert 0 <= readout.fitted_on["metrics"]["lexical_accuracy"] <= 1

    with pytest.raises(InvalidRequest, match=r"a text classifier trained on its example bank.*--example-bank"):
        Decider(smollm2, readout_dir=tmp_path / "readouts").decide(body("Refund please", x_readout=True))
    question = to_decision(parse_request(body("x"))).questions[0]
    bank = ExampleBank.from_pairs(question, None, [(text, TASK.classes[gold]) for text, gold in TEXTS], "bank")
    decider = Decider(smollm2, readout_dir=tmp_path / "readouts", example_banks=[bank])
    answer = decider.answer(body("Refund please", x_readout=True)).answers["answer"]
    assert answer is not None and answer.reads[0].hidden is not None
    (read,) = answer.reads
    vote = bank.vote("Refund please", 3)
    lexical = floored(bank_classifier(bank).probabilities(["Refund please"]))[0]  # the classifier refitted at load
    expected = readout.probabilities(read.logits[None], read.hidden[None], vote, lexical)[0]
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)


def test_an_encoder_readout_sees_only_k_per_class_and_answers_with_the_encoder(
    smollm2: LoadedModel, encoder: SentenceEncoder, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_question_and_train(tmp_path)
    command = ["--cache-dir", str(cache_dir), "fit", "--model", smollm2.name, "--questions", str(tmp_path / "q.json")]
    command += ["--data", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "readouts"), "--per-class", "0"]
    command += ["--seen-per-class", "3", "--l2", "0.1", "--encoder", encoder.name, "--no-progress"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "encoder alone" in out and "; encoder " in out and "(9 held out" in out
    (path,) = (tmp_path / "readouts").glob("*.readout.json")
    readout = Readout.load(path)
    assert readout.encoder == encoder.name and readout.encoder_examples == 9  # the bank: 3 per class, no more
    assert 0 <= readout.encoder_weight <= WEIGHT_MAX and readout.fitted_on["items"] == 9
    assert readout.fitted_on["data"].endswith("3 per class (seed 0)") and readout.fitted_on["prior_items"] > 0

    question = to_decision(parse_request(body("x"))).questions[0]
    bank = ExampleBank.from_pairs(question, None, [(text, TASK.classes[gold]) for text, gold in TEXTS], "bank")
    with pytest.raises(InvalidRequest, match=f"--encoder {encoder.name}"):
        Decider(smollm2, readout_dir=tmp_path / "readouts", example_banks=[bank]).decide(
            body("Refund please", x_readout=True)
        )
    decider = Decider(smollm2, readout_dir=tmp_path / "readouts", example_banks=[bank], encoder=encoder)
    answer = decider.answer(body("Refund please", x_readout=True)).answers["answer"]
    assert answer is not None and answer.reads[0].hidden is not None
    (read,) = answer.reads
    dense = floored(bank_embedding_classifier(bank, encoder.embed).probabilities(["Refund please"]))[0]
    expected = readout.probabilities(read.logits[None], read.hidden[None], dense=dense)[0]
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)


def test_a_readout_fitted_with_hybrid_votes_serves_only_under_hybrid_retrieval(
    smollm2: LoadedModel, encoder: SentenceEncoder, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequest, match="--retrieval dense"):
        fit_readout(Decider(smollm2), DATA, per_class=None, l2=[0.1], vote=3, retrieval="dense", progress=False)
    fit = fit_readout(  # the encoder embeds the hybrid retrieval, and joins the head as a partner too
        Decider(smollm2),
        DATA,
        per_class=None,
        holdout=0.25,
        l2=[0.1],
        vote=3,
        retrieval="hybrid",
        encoder=encoder,
        progress=False,
    )
    assert fit.readout.vote_retrieval == "hybrid" and fit.readout.encoder == encoder.name
    assert "vote_accuracy" in fit.metrics
    fit.readout.save(tmp_path / "readouts")
    question = to_decision(parse_request(body("x"))).questions[0]
    bank = ExampleBank.from_pairs(question, None, [(text, TASK.classes[gold]) for text, gold in TEXTS], "bank")
    served = {"readout_dir": tmp_path / "readouts", "example_banks": [bank], "encoder": encoder}
    with pytest.raises(InvalidRequest, match="ranks them by bm25: serve it with --retrieval hybrid"):
        Decider(smollm2, **served).decide(body("Refund please", x_readout=True))  # type: ignore[arg-type]
    decider = Decider(smollm2, **served, retrieval="hybrid")  # type: ignore[arg-type]
    answer = decider.answer(body("Refund please", x_readout=True)).answers["answer"]
    assert answer is not None and answer.reads[0].hidden is not None
    (read,) = answer.reads
    hybrid = bank.retrieving("hybrid", encoder.embed).vote("Refund please", 3)
    dense = floored(bank_embedding_classifier(bank, encoder.embed).probabilities(["Refund please"]))[0]
    expected = fit.readout.probabilities(read.logits[None], read.hidden[None], hybrid, dense=dense)[0]
    assert answer.probabilities == pytest.approx(expected, abs=1e-12)
