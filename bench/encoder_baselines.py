"""Baselines with no language model on full test sets, each learning from the same K items per class.

For BANKING77, CLINC150 (in-scope: the 150 intents, "out of scope" queries and option left out) and
SST-5, and K in 5, 10 and all: the train split's K per class are drawn as ``slotread eval --per-class K``
draws them (``eval.datasets.per_class_sample``, seed 0), texts the test split also holds left out, and
every system learns from those alone:

- encoder zero-shot (no labels): the option whose name is nearest the state (``quality.examples.meaning``)
- nearest centroid: the class whose mean all-MiniLM-L6-v2 embedding is nearest (cosine)
- LR on embeddings: ``quality.dense`` (the readout's encoder partner)
- TF-IDF + LR: ``quality.lexical`` (``slotread eval --baseline tfidf``)
- BM25 vote / dense vote: the smoothed label vote of the min(K, 24) nearest examples (``quality.examples``;
  dense: by cosine of the embeddings)

Accuracy with its 95% (normal) half-width, ECE, NLL, and the seconds each took. Writes a Markdown
table to stdout and JSON to the path given.

    python bench/encoder_baselines.py runs/encoder-baselines.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from slotread.api.systemone import parse_request, to_decision
from slotread.core.aggregate import softmax
from slotread.eval.banks import bank_from_dataset, without_evaluated
from slotread.eval.datasets import Dataset, load_dataset, per_class_sample
from slotread.eval.metrics import expected_calibration_error
from slotread.models.encoder import load_encoder
from slotread.quality.examples.bank import vote_distribution
from slotread.quality.examples.dense import fit_embedding_classifier
from slotread.quality.examples.lexical import fit_text_classifier, floored
from slotread.quality.examples.meaning import SIMILARITY_TEMPERATURE, Embed, option_text

OUT_OF_SCOPE = "out of scope"
SHOTS: tuple[int | None, ...] = (5, 10, None)


def in_scope(data: Dataset) -> Dataset:
    """CLINC150 without its out-of-scope queries and option."""
    names = list(data.task.question["criteria"])
    drop = names.index(OUT_OF_SCOPE)
    criteria = {n: v for n, v in data.task.question["criteria"].items() if n != OUT_OF_SCOPE}
    task = replace(data.task, question={**data.task.question, "criteria": criteria}, classes=tuple(criteria))
    items = tuple(replace(i, gold=i.gold - (i.gold > drop)) for i in data.items if i.gold != drop)
    return replace(data, task=task, items=items)


def summary(p: np.ndarray, gold: np.ndarray, seconds: float) -> dict[str, float]:
    accuracy = float((p.argmax(axis=1) == gold).mean())
    p = np.clip(p, 1e-12, 1)
    return {
        "accuracy": accuracy,
        "half_width": 1.96 * float(np.sqrt(accuracy * (1 - accuracy) / len(gold))),
        "ece": expected_calibration_error(p, gold),
        "nll": float(-np.log(p[np.arange(len(gold)), gold]).mean()),
        "seconds": seconds,
    }


@dataclass(frozen=True)
class Split:
    """What the few-label systems learn from and answer: K per class of train, and the test set."""

    train: Dataset
    test: Dataset
    e_train: np.ndarray
    e_test: np.ndarray
    k: int

    @property
    def labels(self) -> np.ndarray:
        return np.array([item.gold for item in self.train.items])

    @property
    def states(self) -> list[str]:
        return [item.state for item in self.train.items]

    @property
    def test_states(self) -> list[str]:
        return [item.state for item in self.test.items]

    @property
    def classes(self) -> int:
        return len(self.test.task.classes)


def centroid(split: Split, embed: Embed) -> np.ndarray:
    labels, e_train = split.labels, split.e_train
    means = np.stack([e_train[labels == c].mean(axis=0) for c in range(split.classes)])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    return softmax((split.e_test @ means.T).astype(np.float64) / SIMILARITY_TEMPERATURE)


def dense_lr(split: Split, embed: Embed) -> np.ndarray:
    classifier = fit_embedding_classifier(split.states, split.labels, split.classes, embed)
    return floored(classifier.probabilities(split.test_states))


def tfidf(split: Split, embed: Embed) -> np.ndarray:
    return fit_text_classifier(split.states, split.labels, split.classes).probabilities(split.test_states)


def bm25_vote(split: Split, embed: Embed) -> np.ndarray:
    bank = bank_from_dataset(split.train, split.test)
    return np.stack([bank.vote(state, split.k) for state in split.test_states])


def dense_vote(split: Split, embed: Embed) -> np.ndarray:
    nearest = np.argsort(-(split.e_test @ split.e_train.T), axis=1, kind="stable")[:, : split.k]
    return np.stack([vote_distribution(split.labels[row], split.classes) for row in nearest])


SYSTEMS: tuple[tuple[str, Callable[[Split, Embed], np.ndarray]], ...] = (
    ("nearest centroid", centroid),
    ("LR on embeddings", dense_lr),
    ("TF-IDF + LR", tfidf),
    ("BM25 vote", bm25_vote),
    ("dense vote", dense_vote),
)


def main(out: Path) -> None:
    encoder = load_encoder()
    results = []
    for name in ("banking77", "clinc150", "sst5"):
        test, full_train = load_dataset(name, "test"), load_dataset(name, "train")
        if name == "clinc150":
            test, full_train = in_scope(test), in_scope(full_train)
        gold = np.array([item.gold for item in test.items])
        e_test = encoder.embed([item.state for item in test.items])
        if test.task.kind == "choice":
            question = to_decision(parse_request({"state": "x", "questions": {"q": test.task.question}})).questions[0]
            started = time.perf_counter()
            options = encoder.embed([option_text(question, i) for i in range(len(question.options))])
            p = softmax((e_test @ options.T).astype(np.float64) / SIMILARITY_TEMPERATURE)
            seconds = time.perf_counter() - started
            results.append({"dataset": name, "shots": 0, "system": "encoder zero-shot", **summary(p, gold, seconds)})
        for shots in SHOTS:
            train, _ = without_evaluated(per_class_sample(full_train, shots, 0), test)
            split = Split(
                train, test, encoder.embed([item.state for item in train.items]), e_test, min(shots or 24, 24)
            )
            for system, run in SYSTEMS:
                started = time.perf_counter()
                p = run(split, encoder.embed)
                row = {"dataset": name, "shots": shots or "all", "train_items": len(train.items), "system": system}
                results.append(row | summary(p, gold, time.perf_counter() - started))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("| data (test items) | K per class | system | accuracy ± 95% | ECE | NLL | seconds |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['dataset']} | {r['shots']} | {r['system']} | {r['accuracy']:.1%} ± {r['half_width']:.1%} | "
            f"{r['ece']:.3f} | {r['nll']:.3f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
