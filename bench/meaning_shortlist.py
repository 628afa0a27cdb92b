"""What runs of shortlists from meaning are made of, and the pool exponent w fitted on train-split runs.

Takes finished ``slotread eval --shortlist K --encoder all-minilm-l6-v2`` run folders (no bank), each
given as ``RUN,DATASET[,QUESTIONS]``, and recomputes each item's encoder distribution q
(``quality.examples.meaning``, deterministic). A run's answer is Q_S · normalise((p_read · q)^w₀) on the
list S and q elsewhere, w₀ the exponent the run was made with (run.json's ``pool_exponent``; runs made
before w was fitted, issue 22's H200 runs among them, record none and were made with w₀ = ½), so the
model's read over S is recovered exactly as p_read ∝ (p / Q_S)^(1/w₀) / q (the first CPU samples of
issue 22, made before the pool, answered Q_S · p_read and are not split right here). Then:

- ``--train SPEC`` (repeatable): the w of maximum likelihood of the pooled list on every train run's items
  whose list holds the gold option, all runs together (``meaning.fit_pool_exponent``), and how often
  the list held the gold option against the mean Q_S the answer gives it (the coverage);
- ``--test SPEC`` (repeatable): per run, on the same items, accuracy, ECE and NLL ± 95% (normal
  intervals, the ECE's and NLL's from 1,000 bootstrap draws) of the encoder alone, the read alone
  (Q_S · p_read), the product (w = 1), the pool at w = ½ and the pool at the fitted w (or
  ``POOL_EXPONENT`` without ``--train``), with the fitted pool's ECE minus w = ½'s ± 95% (the same
  draws: paired).

    C=runs/clinc-in
    python bench/meaning_shortlist.py \\
        --train runs/train-b77,banking77:train --train runs/train-clinc,$C/train.jsonl,$C/question.json \\
        --test runs/b77-meaning10,banking77 --test runs/clinc-in-meaning10,$C/test.jsonl,$C/question.json

``DATASET`` is a built-in name (``:SPLIT`` after it, default test) or a labelled file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slotread.api.systemone import parse_request, to_decision
from slotread.eval.datasets import load_dataset
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.report import load_run
from slotread.models.encoder import load_encoder
from slotread.quality.examples.meaning import (
    POOL_EXPONENT,
    Embed,
    fit_pool_exponent,
    nearest_options,
    pool,
    pool_log_likelihood,
    read_from_pool,
    similarity_distribution,
)

BOOTSTRAP = 1000
#: The pool exponent of runs that record none: they were made before it was fitted, with the geometric mean.
UNRECORDED_EXPONENT = 0.5


@dataclass
class Split:
    """A run's items taken apart: q (N, n), the lists (N, k) in option order, the reads over them (N, k)."""

    name: str
    q: np.ndarray
    listed: np.ndarray
    read: np.ndarray
    gold: np.ndarray

    def covered(self) -> np.ndarray:
        return (self.listed == self.gold[:, None]).any(axis=1)

    def answer(self, exponent: float) -> np.ndarray:
        return np.stack([pool(r, q, s, exponent) for r, q, s in zip(self.read, self.q, self.listed, strict=True)])


def split_run(spec: str, embed: Embed) -> Split:
    """``RUN,DATASET[,QUESTIONS]`` taken apart (module docstring)."""
    run, dataset, *questions = spec.split(",")
    name, _, split = dataset.partition(":")
    info, predictions = load_run(Path(run))
    run_exponent = info.get("pool_exponent", UNRECORDED_EXPONENT)
    size = info["request"]["x_shortlist"]
    data = load_dataset(name, split or None, question=Path(questions[0]) if questions else None)
    states = {item.id: item.state for item in data.items}
    question = to_decision(parse_request({"state": "x", "questions": {"q": info["task"]["question"]}})).questions[0]
    embed([states[item_id] for item_id in predictions.ids])  # batched once: each item's q below reads the cache
    qs, lists, reads = [], [], []
    for item_id, p in zip(predictions.ids, predictions.probabilities, strict=True):
        q = similarity_distribution(question, states[item_id], embed)
        listed = list(nearest_options(q, size))
        if not np.allclose(np.delete(p, listed), np.delete(q, listed), atol=1e-5):
            raise SystemExit(f"{run}: item {item_id}'s unread options are not the encoder's q (another encoder or τ?)")
        reads.append(read_from_pool(p, q, listed, run_exponent))
        qs.append(q)
        lists.append(listed)
    return Split(run, np.stack(qs), np.array(lists), np.stack(reads), predictions.gold)


def fit(splits: list[Split]) -> float:
    """w over every train run's items whose list holds the gold option; prints the coverage and the fit."""
    scores, gold = [], []
    for s in splits:
        covered = s.covered()
        listed_q = np.take_along_axis(s.q, s.listed, axis=1)
        held = f"the list held the gold option for {covered.mean():.1%} (mean Q_S {listed_q.sum(axis=1).mean():.3f})"
        print(f"{s.name}: {len(s.gold)} items, {held}")
        scores.append(np.log(np.maximum(s.read * listed_q, 1e-300))[covered])
        gold.append(np.argmax(s.listed == s.gold[:, None], axis=1)[covered])
    z, g = np.concatenate(scores), np.concatenate(gold)
    w = fit_pool_exponent(z, g)
    curve = ", ".join(f"{v:g}: {-pool_log_likelihood(v, z, g) / len(g):.4f}" for v in (0.5, 0.75, 1.0, round(w, 3)))
    best = pool_log_likelihood(w, z, g)
    grid = np.arange(0.05, 2.0, 0.005)
    inside = grid[[best - pool_log_likelihood(v, z, g) <= 1.92 for v in grid]]  # likelihood ratio, χ²₁ at 95%
    print(f"fitted w = {w:.3f} (95%: {inside.min():.3f}-{inside.max():.3f}) on {len(g)} items")
    print(f"mean NLL on the list at w = {curve}")
    return w


def scores(p: np.ndarray, gold: np.ndarray, generator: np.random.Generator) -> tuple[str, np.ndarray]:
    """'accuracy | ECE | NLL (each ± 95%) | mean top p', and the bootstrap draws' ECEs (for paired gaps)."""
    accuracy = float((p.argmax(axis=1) == gold).mean())
    half = 1.96 * np.sqrt(accuracy * (1 - accuracy) / len(gold))
    log_gold = -np.log(np.clip(p[np.arange(len(gold)), gold], 1e-12, 1))
    draws = generator.integers(0, len(gold), size=(BOOTSTRAP, len(gold)))
    eces = np.array([expected_calibration_error(p[d], gold[d]) for d in draws])
    nlls = log_gold[draws].mean(axis=1)
    ece, mean_nll = expected_calibration_error(p, gold), float(log_gold.mean())
    return (
        f"{accuracy:.1%} ± {half:.1%} | {ece:.3f} ± {1.96 * eces.std():.3f} | {mean_nll:.3f} ± {1.96 * nlls.std():.3f} "
        f"| {p.max(axis=1).mean():.3f}",
        eces,
    )


def report(s: Split, exponent: float) -> None:
    held = f"{s.listed.shape[1]}-option lists holding the gold option for {s.covered().mean():.1%}"
    print(f"\n{s.name}: {len(s.gold)} items, {held}")
    print("| answer | accuracy ± 95% | ECE ± 95% | NLL ± 95% | mean top p |\n|---|---:|---:|---:|---:|")
    rows = {
        "encoder alone (no model)": s.q,
        "the read alone, Q_S · p_read": _read_alone(s),
        "product, Q_S · normalise(p_read · q)": s.answer(1.0),
        "pool, w = ½": s.answer(0.5),
        f"pool, w = {exponent:.3f}": s.answer(exponent),
    }
    eces = {}
    for label, p in rows.items():
        # the same bootstrap draws for every row (a fresh generator with one seed): paired intervals
        text, eces[label] = scores(p, s.gold, np.random.default_rng(0))
        print(f"| {label} | {text} |")
    gap = expected_calibration_error(rows[f"pool, w = {exponent:.3f}"], s.gold) - expected_calibration_error(
        rows["pool, w = ½"], s.gold
    )
    spread = 1.96 * (eces[f"pool, w = {exponent:.3f}"] - eces["pool, w = ½"]).std()
    print(f"ECE at w = {exponent:.3f} minus at w = ½: {gap:+.3f} ± {spread:.3f} (paired bootstrap)")


def _read_alone(s: Split) -> np.ndarray:
    full = s.q.copy()
    rows = np.arange(len(s.gold))[:, None]
    full[rows, s.listed] = s.q[rows, s.listed].sum(axis=1, keepdims=True) * s.read
    return full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="append", default=[], metavar="RUN,DATASET[,QUESTIONS]")
    parser.add_argument("--test", action="append", default=[], metavar="RUN,DATASET[,QUESTIONS]")
    args = parser.parse_args()
    if not args.train and not args.test:
        parser.error("give --train and/or --test runs")
    embed = load_encoder().embed
    exponent = fit([split_run(spec, embed) for spec in args.train]) if args.train else POOL_EXPONENT
    for spec in args.test:
        report(split_run(spec, embed), exponent)


if __name__ == "__main__":
    main()
