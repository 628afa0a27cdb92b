"""Thinking before the read, measured on real weights: accuracy, ECE and time per decision at x_think budgets.

    python bench/think_eval.py --dataset boolq --split dev_500 --limit 32 --think 0 64 256 --out runs/think

Each item is one System One request through ``Decider.decide`` (the production path), with ``x_think``
set. On a CPU a greedy thought costs a full forward per token, and rows of a batch share the weights'
read, so the thoughts of a batch of ``--batch`` items are generated first in one engine call (the
engine's own ``think``, recorded from a dry pass of ``decide`` and replayed, so every decision reads
after exactly the thought its request asks for). Reported per budget: accuracy with its 95% Wilson
interval, top-label ECE (10 bins), mean thought tokens, the time of the batched thought generation per
item, and the decide time per item (the read after the cached thought). ``--single K`` also times K
items one at a time, thought included: what one decision costs a caller on this machine.
Results go to ``<out>/<dataset>-think<N>.json`` (one row per item) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slotread import Decider
from slotread.engines.base import ReadRequest, SlotScores
from slotread.engines.thought import ThoughtRequest
from slotread.eval.datasets import load_dataset, subset
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.runner import QUESTION_ID, build_request, read_answer


class _Dry(Exception):
    """Ends a dry pass once the thought requests are known."""


class RecordedThoughts:
    """The Decider's engine with thoughts generated ahead: ``think`` answers from ``known``; in a dry pass
    it records what was asked and stops the decision."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.family, self.noisy, self.max_tokens = engine.family, engine.noisy, engine.max_tokens
        self.known: dict[ThoughtRequest, tuple[int, ...]] = {}
        self.asked: list[ThoughtRequest] | None = None

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        return self.engine.read(requests)

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        if self.asked is not None:
            self.asked += requests
            raise _Dry
        return [self.known[r] if r in self.known else self.engine.think([r])[0] for r in requests]


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--split")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--think", type=int, nargs="+", default=[0, 64, 256])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = subset(load_dataset(args.dataset, args.split), args.limit, 0)
    decider = Decider(model=args.model)
    engine = RecordedThoughts(decider.engine)
    decider.engine = engine  # type: ignore[assignment]
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        "| dataset | x_think | items | accuracy (95% CI) | ECE | thought tokens (mean) | thought s/item (batched) "
        "| read s/item | one decision s (n) |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for budget in args.think:
        fields = {"x_seed": 0, "x_think": budget, "x_thought": True} if budget else {"x_seed": 0}
        rows: list[dict[str, Any]] = []
        think_s = read_s = 0.0
        for start in range(0, len(data.items), args.batch):
            items = data.items[start : start + args.batch]
            requests = [build_request(data.task, item, fields) for item in items]
            if budget:
                engine.asked = []
                for request in requests:
                    with contextlib.suppress(_Dry):
                        decider.decide(request)
                asked, engine.asked = engine.asked, None
                began = time.perf_counter()
                engine.known = dict(zip(asked, engine.engine.think(asked), strict=True))
                think_s += time.perf_counter() - began
            for item, request in zip(items, requests, strict=True):
                began = time.perf_counter()
                response = decider.decide(request)
                read_s += time.perf_counter() - began
                prediction = read_answer(data.task, response)
                answer = response["answers"][QUESTION_ID]
                rows.append(
                    {
                        "id": item.id,
                        "gold": item.gold,
                        "probabilities": prediction.probabilities.tolist(),
                        "output_tokens": response["usage"]["output_tokens"],
                        "thought": answer.get("x_thought"),
                    }
                )
            print(f"  {args.dataset} think {budget}: {len(rows)}/{len(data.items)}", flush=True, file=sys.stderr)
        single: list[float] = []
        for item in data.items[: args.single if budget else 0]:
            engine.known = {}
            began = time.perf_counter()
            decider.decide(build_request(data.task, item, fields))
            single.append(time.perf_counter() - began)
        probabilities = np.array([row["probabilities"] for row in rows])
        gold = np.array([row["gold"] for row in rows])
        correct = int((probabilities.argmax(axis=1) == gold).sum())
        low, high = wilson(correct, len(rows))
        thought_tokens = np.mean([row["output_tokens"] - 1 for row in rows])
        ece = expected_calibration_error(probabilities, gold)
        (args.out / f"{args.dataset}-think{budget}.json").write_text(json.dumps(rows, indent=1))
        one = f"{np.mean(single):.1f} ({len(single)})" if single else "–"
        print(
            f"| {args.dataset} {data.split or ''} | {budget} | {len(rows)} | {correct / len(rows):.3f} "
            f"({low:.3f}–{high:.3f}) | {ece:.3f} | {thought_tokens:.1f} | {think_s / len(rows):.1f} "
            f"| {read_s / len(rows):.2f} | {one} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
