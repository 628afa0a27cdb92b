"""A quick sanity check of answer quality on public labelled data (CPU).

    python bench/cpu_accuracy.py --model qwen2.5-coder-1.5b-instruct --items 80

Rows: SST-5 clearly polar reviews (very negative vs very positive) as a yes/no question;
SST-5 as a 5-level score (exact level and within one level); BoolQ dev as yes/no over passage and
question. This is a smoke test of the plain read, not the evaluation harness.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slotread.decider import Decider

LEVELS = ["very negative", "negative", "neutral", "positive", "very positive"]


def polar_reviews(data_dir: Path, items: int) -> Iterator[tuple[dict[str, Any], bool]]:
    rows = list(csv.DictReader((data_dir / "sst5" / "test.csv").open(encoding="utf-8")))
    negative = [r for r in rows if r["label"] == "0"][: items // 2]
    positive = [r for r in rows if r["label"] == "4"][: items - items // 2]
    question = {"type": "noul", "instructions": "Is this movie review positive?"}
    for row in [*negative, *positive]:
        yield {"state": row["text"], "questions": {"q": question}}, row["label"] == "4"


def graded_reviews(data_dir: Path, items: int) -> Iterator[tuple[dict[str, Any], int]]:
    rows = list(csv.DictReader((data_dir / "sst5" / "test.csv").open(encoding="utf-8")))[:items]
    question = {"type": "score", "instructions": "How positive is this movie review?", "criteria": LEVELS}
    for row in rows:
        yield {"state": row["text"], "questions": {"q": question}}, int(row["label"])


def boolq(data_dir: Path, items: int) -> Iterator[tuple[dict[str, Any], bool]]:
    with (data_dir / "boolq" / "dev_500.jsonl").open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(items), strict=False)]
    for row in rows:
        question = {"type": "noul", "instructions": f"According to the passage: {row['question']}?"}
        yield {"state": row["passage"], "questions": {"q": question}}, row["label"] == "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="model to measure")
    parser.add_argument("--items", type=int, default=80, help="items per row")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="weights dtype")
    default_data = Path(os.environ.get("SLOTREAD_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--data-dir", type=Path, default=default_data, help="$SLOTREAD_DATA, else ../shared/data")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    decider = Decider(args.model, dtype=getattr(torch, args.dtype))
    rows = []
    for name, items in (
        ("SST-5 polar, yes/no", polar_reviews(args.data_dir, args.items)),
        ("BoolQ dev, yes/no", boolq(args.data_dir, args.items)),
    ):
        correct, seconds, count = 0, 0.0, 0
        for request, truth in items:
            start = time.perf_counter()
            p_yes = decider.decide(request)["answers"]["q"]["noul"]
            seconds += time.perf_counter() - start
            correct += (p_yes >= 0.5) == truth
            count += 1
        rows.append((name, count, f"{correct / count:.1%}", "", seconds / count))
    exact = near = count = 0
    seconds = 0.0
    for request, level in graded_reviews(args.data_dir, args.items):
        start = time.perf_counter()
        answer = decider.decide(request)["answers"]["q"]
        seconds += time.perf_counter() - start
        top = int(max(answer["probabilities"], key=answer["probabilities"].get))
        exact += top == level
        near += abs(top - level) <= 1
        count += 1
    rows.append(("SST-5, 5-level score", count, f"{exact / count:.1%}", f"{near / count:.1%}", seconds / count))
    print(f"\n{args.model} {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'set':<22} {'items':>5} {'accuracy':>9} {'within 1':>9} {'s/item':>7}")
    for name, count, accuracy, within, per_item in rows:
        print(f"{name:<22} {count:>5} {accuracy:>9} {within:>9} {per_item:>7.2f}")


if __name__ == "__main__":
    main()
