"""Dataset loaders on small files written here in each real format, and on the copies the package ships."""

import json
import lzma
import re
from dataclasses import replace
from pathlib import Path

import pytest

from slotread.errors import EvalError
from slotread.eval.datasets import (
    BOOLQ_QUESTION,
    BUILTIN,
    CLINC150_OUT_OF_SCOPE,
    PACKAGED_DATA_DIR,
    SST5_LEVELS,
    Dataset,
    Item,
    Task,
    balance,
    class_counts,
    load_dataset,
    per_class_sample,
    readable,
    resolve_data_dir,
    subset,
)


def write_banking77(root: Path) -> Path:
    """A BANKING77 folder as PolyAI ships it (text,category; categories.json), plus our subset154.csv."""
    folder = root / "banking77"
    folder.mkdir(parents=True)
    categories = ["card_arrival", "Refund_not_showing_up", "reverted_card_payment?", "atm_support"]
    (folder / "categories.json").write_text(json.dumps(categories))
    (folder / "test.csv").write_text(
        "text,category\n"
        "Where is my card?,card_arrival\n"
        '"My refund, where is it?",Refund_not_showing_up\n'
        "Why was my payment reverted?,reverted_card_payment?\n"
        "The ATM ate my card,atm_support\n"
        "Still no card,card_arrival\n"
        "Refund missing,Refund_not_showing_up\n"
    )
    (folder / "train.csv").write_text(
        "text,category\nMy card has not come,card_arrival\nWhere is the refund,Refund_not_showing_up\n"
    )
    (folder / "subset154.csv").write_text("test_index,text,category\n4,Still no card,card_arrival\n")
    return folder


def write_clinc150(root: Path) -> None:
    folder = root / "clinc150"
    folder.mkdir(parents=True)
    (folder / "domains.json").write_text(json.dumps({"work": ["pto_request", "w2"], "meta": ["change_ai_name"]}))
    (folder / "test.csv").write_text(
        "text,label\nhow do i get my w2,w2\nsing me a song,oos\nask for time off,pto_request\n"
    )


def write_sst5(root: Path) -> None:
    folder = root / "sst5"
    folder.mkdir(parents=True)
    (folder / "test.csv").write_text(
        'text,label,label_name\n"a gob of drivel , sickly sweet .",0,very negative\ngood fun .,3,positive\n'
    )


def write_boolq(root: Path) -> None:
    folder = root / "boolq"
    folder.mkdir(parents=True)
    rows = [
        {
            "idx": 27,
            "question": "do you need to break in a car",
            "passage": "Engines are broken in.",
            "title": "Break-in",
            "label": "yes",
        },
        {"idx": 3, "question": "is the sky green", "passage": "The sky is blue.", "title": "Sky", "label": "no"},
    ]
    (folder / "dev.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "dev_500.jsonl").write_text(json.dumps(rows[1]) + "\n")


def test_readable_category_names() -> None:
    assert readable("card_payment_fee_charged") == "card payment fee charged"
    assert readable("Refund_not_showing_up") == "refund not showing up"
    assert readable("reverted_card_payment?") == "reverted card payment"
    assert readable("atm_support") == "ATM support"
    assert readable("apple_pay_or_google_pay") == "Apple pay or Google pay"
    assert readable("rollover_401k") == "rollover 401(k)"


def test_banking77_is_one_choice_with_readable_options(tmp_path: Path) -> None:
    write_banking77(tmp_path)
    dataset = load_dataset("banking77", data_dir=tmp_path)
    assert (dataset.name, dataset.split, dataset.task.kind) == ("banking77", "test", "choice")
    assert dataset.task.classes == ("card_arrival", "Refund_not_showing_up", "reverted_card_payment?", "atm_support")
    assert list(dataset.task.question["criteria"]) == [
        "card arrival",
        "refund not showing up",
        "reverted card payment",
        "ATM support",
    ]
    assert [item.id for item in dataset.items] == ["0", "1", "2", "3", "4", "5"]
    assert dataset.items[1].state == "My refund, where is it?" and dataset.items[1].gold == 1
    assert [item.gold for item in dataset.items] == [0, 1, 2, 3, 0, 1]
    assert len(load_dataset("banking77", "train", data_dir=tmp_path).items) == 2


def test_banking77_subset154_keeps_the_test_row_as_id(tmp_path: Path) -> None:
    write_banking77(tmp_path)
    (item,) = load_dataset("banking77", "subset154", data_dir=tmp_path).items
    assert (item.id, item.state, item.gold) == ("4", "Still no card", 0)


def test_clinc150_has_every_intent_then_out_of_scope(tmp_path: Path) -> None:
    write_clinc150(tmp_path)
    dataset = load_dataset("clinc150", data_dir=tmp_path)
    assert dataset.task.classes == ("pto_request", "w2", "change_ai_name", "oos")
    assert dataset.task.positive == "oos"
    name, description = CLINC150_OUT_OF_SCOPE
    assert dataset.task.question["criteria"] == {
        "PTO request": None,
        "W-2": None,
        "change AI name": None,
        name: description,
    }
    assert [item.gold for item in dataset.items] == [1, 3, 0]


def test_sst5_is_a_five_level_score(tmp_path: Path) -> None:
    write_sst5(tmp_path)
    dataset = load_dataset("sst5", data_dir=tmp_path)
    assert dataset.task.kind == "score" and dataset.task.question["criteria"] == list(SST5_LEVELS)
    assert dataset.task.classes == ("0", "1", "2", "3", "4")
    assert [(item.state, item.gold) for item in dataset.items] == [
        ("a gob of drivel , sickly sweet .", 0),
        ("good fun .", 3),
    ]


def test_boolq_puts_each_question_in_the_state_beside_its_passage(tmp_path: Path) -> None:
    write_boolq(tmp_path)
    dataset = load_dataset("boolq", data_dir=tmp_path)
    assert dataset.split == "dev" and dataset.task.kind == "noul" and dataset.task.classes == ("yes", "no")
    assert dataset.task.question == {"type": "noul", "instructions": BOOLQ_QUESTION}
    first, second = dataset.items
    assert (first.id, first.gold) == ("27", 0)
    assert first.state == "Engines are broken in.\n\nQuestion: do you need to break in a car?"
    assert (second.id, second.gold) == ("3", 1)


def test_boolq_dev_rest_is_dev_without_dev_500(tmp_path: Path) -> None:
    write_boolq(tmp_path)
    assert [item.id for item in load_dataset("boolq", "dev_500", data_dir=tmp_path).items] == ["3"]
    assert [item.id for item in load_dataset("boolq", "dev_rest", data_dir=tmp_path).items] == ["27"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_labelled_file_with_a_question_file(tmp_path: Path, suffix: str) -> None:
    question = tmp_path / "question.json"
    question.write_text(
        json.dumps({"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]})
    )
    data = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        data.write_text('{"id": "a", "text": "fire!", "label": "high"}\n\n{"id": "b", "text": "meh", "label": 0}\n')
    else:
        data.write_text("id,text,label\na,fire!,high\nb,meh,0\n")
    dataset = load_dataset(str(data), question=question)
    assert dataset.split is None and dataset.task.classes == ("0", "1", "2")
    assert [(item.id, item.state, item.gold) for item in dataset.items] == [("a", "fire!", 2), ("b", "meh", 0)]


def test_a_labelled_noul_file_reads_yes_no_and_booleans(tmp_path: Path) -> None:
    question = tmp_path / "q.json"
    question.write_text(json.dumps({"type": "noul", "instructions": "Urgent?"}))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x", "label": true}\n{"text": "y", "label": "No"}\n{"text": "z", "label": "yes"}\n')
    dataset = load_dataset(str(data), question=question)
    assert [(item.id, item.gold) for item in dataset.items] == [("0", 0), ("1", 1), ("2", 0)]


def test_a_labelled_file_may_use_the_example_bank_fields(tmp_path: Path) -> None:
    question = tmp_path / "q.json"
    question.write_text(json.dumps({"type": "choice", "criteria": {"outage": None, "billing": None}}))
    data = tmp_path / "d.jsonl"
    data.write_text('{"state": "the site is down", "answer": "outage"}\n{"text": "billed twice", "label": "billing"}\n')
    dataset = load_dataset(str(data), question=question)
    assert [(item.state, item.gold) for item in dataset.items] == [("the site is down", 0), ("billed twice", 1)]
    data.write_text('{"state": "the site is down", "answer": "refund"}\n')
    with pytest.raises(EvalError, match=r"d.jsonl:1: answer 'refund' is not an answer of the question"):
        load_dataset(str(data), question=question)
    data.write_text('{"state": "the site is down"}\n')
    with pytest.raises(EvalError, match=r"d.jsonl:1: no 'text' or 'label' field \(nor 'state' and 'answer'\)"):
        load_dataset(str(data), question=question)


def test_subset_is_seeded_and_keeps_file_order(tmp_path: Path) -> None:
    write_banking77(tmp_path)
    dataset = load_dataset("banking77", data_dir=tmp_path)
    first = subset(dataset, 3, seed=1)
    assert first == subset(dataset, 3, seed=1) and first.sample == (3, 1)
    ids = [int(item.id) for item in first.items]
    assert len(ids) == 3 and ids == sorted(ids)
    assert {tuple(item.id for item in subset(dataset, 3, seed=s).items) for s in range(10)} != {tuple(map(str, ids))}
    assert subset(dataset, 100, seed=1) == dataset and subset(dataset, None, seed=1) == dataset


NOUL = Task("noul", {"type": "noul", "instructions": "Urgent?"}, ("yes", "no"))
# 7 yes, 3 no, as BoolQ's dev_rest leans to yes (64%)
LEANING = Dataset("d.jsonl", None, NOUL, tuple(Item(str(i), f"text {i}", 0 if i < 7 else 1) for i in range(10)))


def test_per_class_sample_keeps_at_most_that_many_of_each_class_seeded_in_file_order() -> None:
    sampled = per_class_sample(LEANING, 4, seed=0)
    assert [item.gold for item in sampled.items] == [0, 0, 0, 0, 1, 1, 1]  # 4 of 7 yes, all 3 no
    assert sampled == per_class_sample(LEANING, 4, seed=0) and per_class_sample(LEANING, None, 0) == LEANING


def test_balance_keeps_the_smallest_class_count_of_every_class() -> None:
    assert class_counts(LEANING) == {"yes": 7, "no": 3}
    balanced = balance(LEANING, None, seed=0)
    assert class_counts(balanced) == {"yes": 3, "no": 3} and balanced.balanced
    assert balanced.sample == (6, 0) and [item.id for item in balanced.items][-3:] == ["7", "8", "9"]
    ids = [int(item.id) for item in balanced.items]
    assert ids == sorted(ids) and balance(LEANING, None, seed=0) == balanced
    assert balance(LEANING, 6, seed=0) == balanced  # a sample's (size, seed) draws it again
    assert {tuple(item.id for item in balance(LEANING, None, seed=s).items) for s in range(10)} != {
        tuple(map(str, ids))
    }


def test_a_limit_keeps_its_share_of_every_class() -> None:
    # limit 5 over 2 classes: 5 // 2 = 2 of each, 4 items (never 3 and 2)
    assert class_counts(balance(LEANING, 5, seed=1)) == {"yes": 2, "no": 2}
    # a limit above the balanced size changes nothing
    assert balance(LEANING, 100, seed=0) == balance(LEANING, None, seed=0)
    # balanced data is kept whole: marked balanced, and not a sample when it was not one
    even = balance(LEANING, 6, seed=0)
    assert balance(even, None, seed=3) == even
    whole = Dataset("d.jsonl", None, NOUL, LEANING.items[4:])
    assert balance(whole, None, seed=3) == replace(whole, balanced=True) and balance(whole, None, seed=3).sample is None


def test_balance_refuses_a_class_without_items_and_a_limit_below_the_classes() -> None:
    only_yes = Dataset("d.jsonl", None, NOUL, LEANING.items[:7])
    with pytest.raises(EvalError, match=re.escape("d.jsonl has no items of class 'no' (of 2 classes)")):
        balance(only_yes, None, seed=0)
    with pytest.raises(EvalError, match="a balanced sample of 2 classes needs a limit of at least 2"):
        balance(LEANING, 1, seed=0)


def test_the_data_dir_comes_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTREAD_DATA", "/from/env")
    assert resolve_data_dir(Path("/flag")) == Path("/flag")
    assert resolve_data_dir(None) == Path("/from/env")
    monkeypatch.delenv("SLOTREAD_DATA")
    assert resolve_data_dir(None) == PACKAGED_DATA_DIR


#: The sizes each PROVENANCE.md gives (BoolQ's dev_rest: dev without dev_500).
SHIPPED_SIZES = {
    ("banking77", "test"): 3_080,
    ("banking77", "train"): 10_003,
    ("banking77", "subset154"): 154,
    ("clinc150", "test"): 5_500,
    ("clinc150", "val"): 3_100,
    ("clinc150", "train"): 15_100,
    ("clinc150", "test_2per_label"): 302,
    ("sst5", "test"): 2_210,
    ("sst5", "val"): 1_101,
    ("sst5", "train"): 8_544,
    ("boolq", "dev"): 3_270,
    ("boolq", "dev_500"): 500,
    ("boolq", "dev_rest"): 2_770,
}


def test_every_split_of_the_shipped_data_loads_whole_with_no_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTREAD_DATA", raising=False)
    monkeypatch.chdir("/")  # nothing beside the working directory is read
    assert {(name, split) for name, (_, splits) in BUILTIN.items() for split in splits} == set(SHIPPED_SIZES)
    for (name, split), size in SHIPPED_SIZES.items():
        dataset = load_dataset(name, split)
        assert len(dataset.items) == size, (name, split)
        assert len({item.id for item in dataset.items}) == size, (name, split)
    assert class_counts(load_dataset("sst5")) == {"0": 279, "1": 633, "2": 389, "3": 510, "4": 399}
    assert len(load_dataset("clinc150").task.classes) == 151
    assert sum(item.gold == 0 for item in load_dataset("boolq", "dev_500").items) == 250  # 250 yes, 250 no


def test_every_shipped_set_carries_its_provenance_and_licence() -> None:
    for name in BUILTIN:
        folder = PACKAGED_DATA_DIR / name
        assert (folder / "PROVENANCE.md").is_file()
        assert any(path.name.startswith("LICENSE") for path in folder.iterdir()), name


def test_a_data_dir_may_hold_xz_compressed_files(tmp_path: Path) -> None:
    folder = write_banking77(tmp_path)
    plain = load_dataset("banking77", data_dir=tmp_path)
    test = folder / "test.csv"
    (folder / "test.csv.xz").write_bytes(lzma.compress(test.read_bytes()))
    test.unlink()
    assert load_dataset("banking77", data_dir=tmp_path) == plain


def test_a_missing_data_dir_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="no sst5 data") as error:
        load_dataset("sst5", data_dir=tmp_path / "nowhere")
    assert str((tmp_path / "nowhere" / "sst5").resolve()) in str(error.value)
    assert "SLOTREAD_DATA" in str(error.value)


@pytest.mark.parametrize(
    ("dataset", "split", "message"),
    [
        ("imdb", None, "unknown dataset 'imdb': name one of banking77, clinc150, sst5, boolq"),
        ("boolq", "train", "boolq has no split 'train'; its splits: dev, dev_500"),
    ],
)
def test_unknown_datasets_and_splits_are_refused(dataset: str, split: str | None, message: str) -> None:
    with pytest.raises(EvalError, match=message):
        load_dataset(dataset, split)


def test_a_label_outside_the_classes_names_its_line(tmp_path: Path) -> None:
    folder = write_banking77(tmp_path)
    (folder / "test.csv").write_text("text,category\nok,card_arrival\nbad,no_such_intent\n")
    with pytest.raises(EvalError, match=r"test.csv:3: label 'no_such_intent' is not one of the 4 classes"):
        load_dataset("banking77", data_dir=tmp_path)


@pytest.mark.parametrize(
    ("question", "rows", "message"),
    [
        (
            {"type": "choice", "criteria": {"a": None, "b": None}},
            '{"text": "x", "label": "c"}\n',
            r"d.jsonl:1: label 'c'",
        ),
        ({"type": "noul"}, '{"text": "x"}\n', r"d.jsonl:1: no 'label' field"),
        ({"type": "noul"}, '{"text": 3, "label": "yes"}\n', r"'text' must be a string"),
        ({"type": "noul"}, "not json\n", r"d.jsonl:1: not JSON"),
        ({"type": "choice"}, '{"text": "x", "label": "a"}\n', "a choice question needs its criteria"),
        ({"type": "ranking"}, '{"text": "x", "label": "a"}\n', "type noul, choice or score"),
    ],
)
def test_a_malformed_labelled_file_is_refused_with_its_location(
    tmp_path: Path, question: dict[str, object], rows: str, message: str
) -> None:
    (tmp_path / "q.json").write_text(json.dumps(question))
    (tmp_path / "d.jsonl").write_text(rows)
    with pytest.raises(EvalError, match=message):
        load_dataset(str(tmp_path / "d.jsonl"), question=tmp_path / "q.json")


def test_a_labelled_file_needs_a_question_file(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("text,label\nx,yes\n")
    with pytest.raises(EvalError, match="needs a question file"):
        load_dataset(str(tmp_path / "d.csv"))
    with pytest.raises(EvalError, match="cannot read the question file"):
        load_dataset(str(tmp_path / "d.csv"), question=tmp_path / "missing.json")
