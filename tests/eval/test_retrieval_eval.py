"""``slotread eval --retrieval``: the neighbour vote and a model's examples ranked by words, meaning or both,
with the real all-MiniLM-L6-v2, on a tiny BANKING77-format folder whose test messages paraphrase the train ones."""

import json
from pathlib import Path

import pytest

from slotread.cli import main
from slotread.core.questions import Option, Question
from slotread.decider import Decider
from slotread.errors import ExampleBankError
from slotread.eval.datasets import load_dataset
from slotread.eval.evaluate import _bank
from slotread.eval.report import compare
from slotread.models.encoder import SentenceEncoder
from slotread.models.load import LoadedModel
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.meaning import POOL_EXPONENT
from slotread.settings import EvalSettings
from tests.eval.banking77 import write_banking77

CATEGORIES = ["card_arrival", "request_refund", "lost_or_stolen_card"]
TRAIN = [
    ("my card still has not come", "card_arrival"),
    ("when will the card be delivered", "card_arrival"),
    ("give me a refund please", "request_refund"),
    ("refund the wrong payment", "request_refund"),
    ("my card was stolen today", "lost_or_stolen_card"),
    ("i cannot find my card anywhere", "lost_or_stolen_card"),
]
#: the nearest train message by words: "give me a refund please" (refund), "i cannot find my card anywhere"
#: (lost), "my card still has not come" (card); by meaning: the stolen card, the refund, the card not come
TEST = [
    ("a thief took it from my pocket", "lost_or_stolen_card"),
    ("i would like my money back", "request_refund"),
    ("it is taking ages to get here", "card_arrival"),
]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return write_banking77(tmp_path / "data", CATEGORIES, {"train": TRAIN, "test": TEST})


def vote(cache_dir: Path, data_dir: Path, out: Path, *flags: str) -> int:
    argv = ["--cache-dir", str(cache_dir), "eval", "--baseline", "knn", "--examples", "1", "--dataset", "banking77"]
    return main([*argv, "--data-dir", str(data_dir), *flags, "--out", str(out), "--no-progress"])


def test_the_vote_by_meaning_finds_the_paraphrases_words_miss(
    cache_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    encoder = ["--encoder", "all-minilm-l6-v2"]
    assert vote(cache_dir, data_dir, tmp_path / "bm25") == 0
    assert vote(cache_dir, data_dir, tmp_path / "dense", "--retrieval", "dense", *encoder) == 0
    assert vote(cache_dir, data_dir, tmp_path / "hybrid", "--retrieval", "hybrid", *encoder) == 0
    printed = capsys.readouterr().out
    assert "| bm25-vote-1 |" in printed and "| dense-vote-1 |" in printed and "| hybrid-vote-1 |" in printed
    accuracy = {r: json.loads((tmp_path / r / "metrics.json").read_text())["accuracy"] for r in ("bm25", "dense")}
    assert accuracy == {"bm25": pytest.approx(1 / 3), "dense": 1.0}
    # the fusion keeps BM25's match for the money message ("my" is in the stolen and lost ones) first
    assert json.loads((tmp_path / "hybrid" / "metrics.json").read_text())["accuracy"] == pytest.approx(2 / 3)
    paired = compare(tmp_path / "dense", tmp_path / "bm25")
    assert (paired.a_only, paired.b_only) == (2, 0)
    bank = json.loads((tmp_path / "dense" / "run.json").read_text())["example_bank"]
    assert bank["retrieval"] == "dense" and bank["examples"] == 6


@pytest.mark.parametrize("retrieval", ["dense", "hybrid"])
def test_eval_refuses_retrieval_by_meaning_without_an_encoder(
    cache_dir: Path, data_dir: Path, tmp_path: Path, retrieval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert vote(cache_dir, data_dir, tmp_path / "run", "--retrieval", retrieval) == 1
    assert f"--retrieval {retrieval} ranks bank examples by their sentence embeddings" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_model_shows_the_examples_its_retrieval_finds(cache_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["--cache-dir", str(cache_dir), "eval", "--model", "smollm2-135m-instruct", "--dataset", "banking77"]
    argv += ["--data-dir", str(data_dir), "--limit", "1", "--examples", "1", "--retrieval", "hybrid"]
    assert main([*argv, "--encoder", "all-minilm-l6-v2", "--out", str(out), "--no-progress"]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["example_bank"]["retrieval"] == "hybrid" and info["request"]["x_examples"] == 1
    assert info["encoder"] == "all-minilm-l6-v2" and info["pool_exponent"] == POOL_EXPONENT  # re-poolable offline


def test_a_decider_ranks_its_banks_by_its_retrieval(smollm2: LoadedModel, encoder: SentenceEncoder) -> None:
    question = Question("topic", "choice", "Which?", tuple(Option(n) for n in ("card", "refund", "lost")))
    names = {"card_arrival": "card", "request_refund": "refund", "lost_or_stolen_card": "lost"}
    bank = ExampleBank.from_pairs(question, None, [(t, names[label]) for t, label in TRAIN], "bank")
    decider = Decider(smollm2, example_banks=[bank], encoder=encoder, retrieval="dense")
    served = decider.banks.get(bank.schema)
    assert served is not None and served.retrieval == "dense" and decider.readouts.retrieval == "dense"
    assert served.ranking(TEST[0][0], 1) == [4] and bank.ranking(TEST[0][0], 1) == [2]
    with pytest.raises(ExampleBankError, match="--retrieval hybrid"):
        Decider(smollm2, example_banks=[bank], retrieval="hybrid")


def test_a_shortlist_under_dense_retrieval_comes_from_the_bank_not_from_meaning(
    cache_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    fields = {"dataset": "banking77", "data_dir": data_dir, "out": tmp_path, "shortlist": 2}
    fields |= {"encoder": "all-minilm-l6-v2", "cache_dir": cache_dir}
    dataset = load_dataset("banking77", data_dir=data_dir)
    assert _bank(EvalSettings(**fields), dataset) is None  # BM25: no labels needed, shortlists from meaning
    bank = _bank(EvalSettings(**fields, retrieval="dense"), dataset)
    assert bank is not None and bank.retrieval == "dense" and len(bank) == len(TRAIN)
