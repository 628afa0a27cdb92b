"""What a run of shortlists from meaning is made of: the encoder alone, the model's read, and their product.

Takes a finished ``slotread eval --shortlist K --encoder all-minilm-l6-v2`` run folder (no bank), and
recomputes each item's encoder distribution q (``quality.examples.meaning``, deterministic). The run's answer
is Q_S · p_read on the shortlist S and q elsewhere, so the model's read p_read over S is recovered
exactly as p / Q_S. Reports, on the same items, accuracy ± 95%, ECE and NLL of:

- encoder alone: q (the option nearest in meaning, no model);
- the run's answer: Q_S · p_read on S, q off it;
- product: Q_S · normalise(p_read · q) on S, q off it (the model's read weighed by the encoder's q);
- pool: Q_S · normalise(√(p_read · q)) on S, q off it (the logarithmic opinion pool, equal weights);

and how often S held the gold option.

    python bench/meaning_shortlist.py RUN --dataset banking77
    python bench/meaning_shortlist.py RUN --dataset runs/clinc-in/test.jsonl --questions runs/clinc-in/question.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from slotread.api.systemone import parse_request, to_decision
from slotread.eval.datasets import load_dataset
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.report import load_run
from slotread.models.encoder import load_encoder
from slotread.quality.examples.meaning import nearest_options, similarity_distribution


def scores(p: np.ndarray, gold: np.ndarray) -> str:
    accuracy = float((p.argmax(axis=1) == gold).mean())
    half = 1.96 * np.sqrt(accuracy * (1 - accuracy) / len(gold))
    nll = float(-np.log(np.clip(p[np.arange(len(gold)), gold], 1e-12, 1)).mean())
    return f"{accuracy:.1%} ± {half:.1%} | {expected_calibration_error(p, gold):.3f} | {nll:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--questions", type=Path)
    args = parser.parse_args()
    info, predictions = load_run(args.run)
    size = info["request"]["x_shortlist"]
    data = load_dataset(args.dataset, info["split"], question=args.questions)
    states = {item.id: item.state for item in data.items}
    question = to_decision(parse_request({"state": "x", "questions": {"q": info["task"]["question"]}})).questions[0]
    embed = load_encoder().embed
    encoder, product, pool, held = [], [], [], []
    for item_id, p in zip(predictions.ids, predictions.probabilities, strict=True):
        q = similarity_distribution(question, states[item_id], embed)
        listed = list(nearest_options(q, size))
        mass = q[listed].sum()
        read = p[listed] / p[listed].sum()
        weighed = read * q[listed]
        fused = q.copy()
        fused[listed] = mass * weighed / weighed.sum()
        pooled = q.copy()
        pooled[listed] = mass * np.sqrt(weighed) / np.sqrt(weighed).sum()
        encoder.append(q)
        product.append(fused)
        pool.append(pooled)
        held.append(listed)
    gold = predictions.gold
    inside = np.mean([g in s for g, s in zip(gold, held, strict=True)])
    print(f"{args.run}: {len(gold)} items, {size}-option shortlists holding the gold option for {inside:.1%}")
    print("| answer | accuracy ± 95% | ECE | NLL |\n|---|---:|---:|---:|")
    print(f"| encoder alone (no model) | {scores(np.stack(encoder), gold)} |")
    print(f"| the run: Q_S · p_read, q off the list | {scores(predictions.probabilities, gold)} |")
    print(f"| product: Q_S · normalise(p_read · q) | {scores(np.stack(product), gold)} |")
    print(f"| pool: Q_S · normalise(√(p_read · q)) | {scores(np.stack(pool), gold)} |")
    latency = predictions.latency_ms
    print(json.dumps({"latency_p50_ms": float(np.median(latency)), "latency_mean_ms": float(latency.mean())}))


if __name__ == "__main__":
    main()
