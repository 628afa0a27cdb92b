"""``slotread eval``, run in process: SmolLM2 on a tiny BANKING77-format folder, resumed; compare; table."""

import json
import shutil
from pathlib import Path

import pytest

from slotread.cli import main
from tests.eval.banking77 import write_banking77

CATEGORIES = ["card_arrival", "request_refund", "lost_or_stolen_card"]
MESSAGES = [
    ("My new card has not arrived yet", "card_arrival"),
    ("I want my money back for this purchase", "request_refund"),
    ("Someone stole my card", "lost_or_stolen_card"),
    ("Where is the card you sent me?", "card_arrival"),
    ("Please refund the double charge", "request_refund"),
    ("I lost my card on the bus", "lost_or_stolen_card"),
]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return write_banking77(tmp_path / "data", CATEGORIES, {"test": MESSAGES, "train": MESSAGES})


def rows(out: Path) -> list[str]:
    return (out / "predictions.csv").read_text().splitlines()


def test_eval_runs_and_resumes_without_rereading_finished_items(
    cache_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["--cache-dir", str(cache_dir), "eval", "--model", "smollm2-135m-instruct", "--dataset", "banking77"]
    argv += ["--data-dir", str(data_dir), "--limit", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| smollm2-135m-instruct | banking77 | test | 4 |" in table
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["items"] == 4 and metrics["reads_per_item"] == 1.0
    assert (out / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    first = rows(out)
    assert first[0].endswith("p:card_arrival,p:request_refund,p:lost_or_stolen_card") and len(first) == 5
    correct = [line.split(",")[3] for line in first[1:]]
    assert metrics["accuracy"] == pytest.approx(correct.count("1") / 4)

    # a run killed during its third item: two rows and a torn one
    (out / "predictions.csv").write_text("\n".join(first[:3]) + "\n" + first[3][:20])
    (out / "metrics.json").unlink()
    assert main(argv) == 0
    resumed = rows(out)
    assert resumed[:3] == first[:3]  # the finished rows, latencies included, are untouched
    assert [line.split(",")[0] for line in resumed] == [line.split(",")[0] for line in first]
    assert json.loads((out / "metrics.json").read_text())["items"] == 4

    # a finished run reads nothing
    assert main(argv) == 0
    assert rows(out) == resumed


def test_eval_refuses_a_folder_holding_another_run(
    bank_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["eval", "--baseline", "tfidf", "--dataset", "banking77", "--data-dir", str(bank_data_dir)]
    base += ["--no-progress"]
    assert main([*base, "--out", str(tmp_path / "run")]) == 0
    assert main([*base, "--limit", "3", "--out", str(tmp_path / "run")]) == 1
    assert "holds another run (it differs in limit, sample_seed)" in capsys.readouterr().err


def test_eval_compare_and_table(bank_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["eval", "--baseline", "tfidf", "--dataset", "banking77", "--data-dir", str(bank_data_dir)]
    base += ["--no-progress"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "paired items: 6" in out and "only A right: 0, only B right: 0" in out and "McNemar p = 1" in out
    assert main(["eval", "table", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.count("| tfidf-logreg | banking77 | test | 6 |") == 2
    (tmp_path / "note.json").write_text("{}")
    for stray in (tmp_path / "note.json", tmp_path / "missing"):  # a file or no folder: exit 1, no traceback
        assert main(["eval", "table", str(stray)]) == 1
        assert "has no metrics.json" in capsys.readouterr().err


def test_eval_shuffle_options_and_the_flip_rate(
    cache_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cache-dir", str(cache_dir), "eval", "--model", "smollm2-135m-instruct", "--dataset", "banking77"]
    argv += ["--data-dir", str(data_dir), "--limit", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert main([*argv, "--shuffle-options", "1", "--out", str(tmp_path / "shuffled")]) == 0
    assert json.loads((tmp_path / "shuffled" / "run.json").read_text())["shuffle_options"] == 1
    assert rows(tmp_path / "shuffled")[0] == rows(tmp_path / "plain")[0]  # same classes, same column order
    predicted = [[line.split(",")[2] for line in rows(tmp_path / run)[1:]] for run in ("plain", "shuffled")]
    flips = sum(a != b for a, b in zip(*predicted, strict=True))
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "plain"), str(tmp_path / "shuffled")]) == 0
    assert f"predicted class differs (flip rate): {flips / 4:.3f} ({flips} of 4)" in capsys.readouterr().out


def test_eval_refuses_shuffle_options_without_a_choice(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["eval", "--dataset", "banking77", "--data-dir", str(data_dir), "--shuffle-options", "1"]
    assert main([*base, "--baseline", "tfidf", "--out", str(tmp_path / "run")]) == 1
    assert "the baseline reads none" in capsys.readouterr().err
    (tmp_path / "q.json").write_text(json.dumps({"type": "score", "criteria": ["bad", "good"]}))
    (tmp_path / "d.csv").write_text("text,label\nlovely,1\n")
    argv = ["eval", "--model", "no-such-model", "--dataset", str(tmp_path / "d.csv"), "--question"]
    assert main([*argv, str(tmp_path / "q.json"), "--shuffle-options", "1", "--out", str(tmp_path / "run")]) == 1
    assert "reorders a choice question's options; this task is a score" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--dataset", "sst5", "--data-dir", "/no/such/dir", "--out", "x"], "/no/such/dir/sst5"),
        (["eval", "--dataset", "imdb", "--out", "x"], "unknown dataset 'imdb'"),
        (["eval", "--dataset", "sst5"], "--dataset and --out are required"),
        (["eval", "compare", "/no/run", "/no/run"], "not a run folder"),
        (["eval", "table", "/no/run"], "has no metrics.json"),
    ],
)
def test_eval_errors_exit_1_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_a_bad_request_field_exits_2_before_loading(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--model", "no-such-model", "--dataset", "banking77", "--data-dir", str(data_dir)]
    assert main([*argv, "--request-field", "x_samples=0", "--out", str(tmp_path / "run")]) == 2
    assert json.loads(capsys.readouterr().err)["detail"][0]["loc"] == ["body", "x_samples"]
    with pytest.raises(SystemExit):
        main([*argv, "--request-field", "x_samples", "--out", str(tmp_path / "run")])


def test_the_baseline_on_a_labelled_file_trains_on_the_train_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q.json").write_text(json.dumps({"type": "noul", "instructions": "Is the customer angry?"}))
    train = [("this is outrageous", "yes"), ("i am furious", "yes"), ("thanks a lot", "no"), ("all good", "no")]
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in train))
    (tmp_path / "test.csv").write_text("text,label\nso furious right now,yes\nthanks,no\n")
    argv = [
        "eval",
        "--baseline",
        "tfidf",
        "--dataset",
        str(tmp_path / "test.csv"),
        "--question",
        str(tmp_path / "q.json"),
    ]
    assert main([*argv, "--train", str(tmp_path / "train.csv"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["items"] == 2
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"] == [str(tmp_path / "train.csv"), None]


@pytest.fixture
def bank_data_dir(data_dir: Path) -> Path:
    """The tiny set with a train split of other messages, so a bank from it holds no evaluated text."""
    train = [
        ("my card still has not come", "card_arrival"),
        ("when will the card be delivered", "card_arrival"),
        ("give me a refund please", "request_refund"),
        ("refund the wrong payment", "request_refund"),
        ("my card was stolen today", "lost_or_stolen_card"),
        ("i cannot find my card anywhere", "lost_or_stolen_card"),
    ]
    rows = "".join(f"{text},{label}\n" for text, label in train)
    (data_dir / "banking77" / "train.csv").write_text("text,category\n" + rows)
    return data_dir


def test_eval_with_examples_and_a_shortlist_records_the_bank(
    cache_dir: Path, bank_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["--cache-dir", str(cache_dir), "eval", "--model", "smollm2-135m-instruct", "--dataset", "banking77"]
    argv += ["--data-dir", str(bank_data_dir), "--limit", "2", "--examples", "2", "--shortlist", "2"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["request"] == {"x_seed": 0, "x_examples": 2, "x_shortlist": 2}
    assert info["example_bank"]["source"] == "banking77 train" and info["example_bank"]["examples"] == 6
    _, *lines = rows(out)
    for line in lines:
        p = [float(v) for v in line.split(",")[-3:]]
        assert sum(p) == pytest.approx(1.0) and min(p) > 0


def test_eval_knn_votes_with_the_train_split(
    bank_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--baseline", "knn", "--examples", "3", "--dataset", "banking77"]
    assert main([*argv, "--data-dir", str(bank_data_dir), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "| bm25-vote-3 | banking77 | test | 6 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message", "code"),
    [
        (["--baseline", "knn"], "at least 1", 1),
        (["--baseline", "knn", "--examples", "3", "--shortlist", "2"], "reads no shortlist", 1),
        (["--baseline", "tfidf", "--examples", "3"], "shows no examples", 1),
        (["--baseline", "tfidf", "--example-bank", "bank.jsonl"], "shows no examples", 1),
        (["--example-bank", "bank.jsonl"], "--example-bank serves", 1),
        (["--baseline", "knn", "--examples", "3", "--example-bank", "bank.jsonl"], "--example-bank must name data", 2),
    ],
)
def test_eval_refuses_banks_that_make_no_sense(
    bank_data_dir: Path, tmp_path: Path, flags: list[str], message: str, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    question = {"type": "choice", "instructions": "Which of these topics is this bank customer's message about?"}
    question["criteria"] = {"card arrival": None, "request refund": None, "lost or stolen card": None}
    lines = [{"question": question}, {"state": "Someone stole my card", "answer": "lost or stolen card"}]
    (tmp_path / "bank.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = [str(tmp_path / flag) if flag == "bank.jsonl" else flag for flag in flags]
    argv = ["eval", *flags, "--dataset", "banking77", "--data-dir", str(bank_data_dir), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == code
    assert message in capsys.readouterr().err


def labelled_file(tmp_path: Path) -> list[str]:
    """A labelled file and its question, as ``eval`` arguments."""
    question = {"type": "choice", "instructions": "Which topic?", "criteria": {"card": None, "refund": None}}
    (tmp_path / "q.json").write_text(json.dumps(question))
    rows = [("where is my card", "card"), ("card not here", "card"), ("refund me", "refund"), ("money back", "refund")]
    (tmp_path / "test.csv").write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in rows))
    return ["eval", "--dataset", str(tmp_path / "test.csv"), "--question", str(tmp_path / "q.json"), "--no-progress"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--baseline", "tfidf"],
        ["--baseline", "knn", "--examples", "2"],
        ["--baseline", "knn", "--examples", "2", "--limit", "2"],  # once the bank was the rest of the file
        ["--model", "no-such-model", "--examples", "2"],
        ["--model", "no-such-model", "--shortlist", "2"],
    ],
)
def test_nothing_evaluated_is_trained_on_without_train(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = labelled_file(tmp_path)
    assert main([*argv, *flags, "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "--train FILE" in err and "nothing evaluated is ever trained on" in err
    assert not (tmp_path / "run").exists()
    # the evaluated file named as its own training file is refused too
    assert main([*argv, *flags, "--train", str(tmp_path / "test.csv"), "--out", str(tmp_path / "run")]) == 1
    assert "the data being evaluated" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--baseline", "tfidf"], ["--baseline", "knn", "--examples", "2"]])
def test_a_built_in_fitting_split_is_not_evaluated_against_itself(
    bank_data_dir: Path, tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", *flags, "--dataset", "banking77", "--split", "train", "--data-dir", str(bank_data_dir)]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 1
    assert "banking77 train, the data being evaluated" in capsys.readouterr().err


def test_the_tfidf_baseline_drops_train_texts_it_evaluates(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # data_dir's train split repeats every test message: nothing is left to learn from
    argv = ["eval", "--baseline", "tfidf", "--dataset", "banking77", "--data-dir", str(data_dir)]
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 1
    assert "needs at least two classes" in capsys.readouterr().err


def test_per_class_limits_what_the_vote_sees(bank_data_dir: Path, tmp_path: Path) -> None:
    argv = ["eval", "--baseline", "knn", "--examples", "3", "--dataset", "banking77", "--per-class", "1"]
    assert main([*argv, "--data-dir", str(bank_data_dir), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    bank = json.loads((tmp_path / "run" / "run.json").read_text())["example_bank"]
    assert bank["examples"] == 3 and bank["source"] == "banking77 train, 1 per class (seed 0)"
