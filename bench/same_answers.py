"""Same request, same answer through a real ``slotread serve``: BANKING77 and SST-5 requests answered
alone and interleaved in concurrent bursts, first after a start and with a warm cache.

    python bench/same_answers.py --model qwen2.5-coder-1.5b-instruct --limit 100

Starts ``slotread serve`` (its defaults, except ``--max-concurrency`` and ``--queue-size`` set to the
burst size so a burst's decisions run together and their reads share engine batches), then answers
``--limit`` requests of each dataset (the eval's requests, interleaved): (1) each alone, in order,
right after the start; (2) all of them shuffled into bursts of ``--burst`` concurrent decisions;
(3) each alone again, with the cache warm. It restarts the server and (4) answers the bursts first.
Per pass it prints the largest difference of any answer number (probabilities, confidences,
entropies, label masses) from pass (1), how many answers differ by more than 1e-6, the reads per
engine batch and the wall time.
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from helpers import free_port, start, stop, wait_ready

from slotread.eval.datasets import load_dataset, subset
from slotread.eval.runner import build_request

Answer = dict[str, Any]


def requests(limit: int, seed: int) -> list[dict[str, Any]]:
    """``limit`` SST-5 and ``limit`` BANKING77 requests, interleaved."""
    sets = [load_dataset(name) for name in ("sst5", "banking77")]
    picked = [[build_request(data.task, item, {}) for item in subset(data, limit, seed).items] for data in sets]
    return [request for pair in zip(*picked, strict=True) for request in pair]


def numbers(value: Any, path: str = "") -> dict[str, float]:
    """Every number in an answer, keyed by its path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in numbers(item, f"{path}/{key}").items()}
    if isinstance(value, bool) or not isinstance(value, int | float):
        return {}
    return {path: float(value)}


def counter(client: httpx.Client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def answer(client: httpx.Client, request: dict[str, Any]) -> Answer:
    answers: Answer = client.post("/v1/systemone", json=request).raise_for_status().json()["answers"]
    return answers


def alone(client: httpx.Client, batch: list[dict[str, Any]]) -> list[Answer]:
    return [answer(client, request) for request in batch]


def in_bursts(client: httpx.Client, batch: list[dict[str, Any]], burst: int, seed: int) -> list[Answer]:
    """Every request of ``batch`` once, in a seeded random order, ``burst`` of them at a time concurrently."""
    order = list(range(len(batch)))
    random.Random(seed).shuffle(order)
    answers: dict[int, Answer] = {}
    with ThreadPoolExecutor(burst) as pool:
        for start_at in range(0, len(order), burst):
            part = order[start_at : start_at + burst]
            answers.update(zip(part, pool.map(lambda i: answer(client, batch[i]), part), strict=True))
    return [answers[i] for i in range(len(batch))]


def compare(reference: list[Answer], other: list[Answer]) -> tuple[float, int]:
    """The largest difference of any answer number, and the answers differing by more than 1e-6."""
    worst, differing = 0.0, 0
    for a, b in zip(reference, other, strict=True):
        na, nb = numbers(a), numbers(b)
        if na.keys() != nb.keys():
            raise SystemExit(f"answers of different shapes: {sorted(na)} vs {sorted(nb)}")
        gap = max(abs(na[key] - nb[key]) for key in na)
        worst, differing = max(worst, gap), differing + (gap > 1e-6)
    return worst, differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="model to serve")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype")
    parser.add_argument("--limit", type=int, default=100, help="requests of each dataset")
    parser.add_argument("--burst", type=int, default=32, help="concurrent decisions of a burst")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset sample and the burst order")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra argument for slotread serve")
    args = parser.parse_args()
    batch = requests(args.limit, args.seed)
    passes: list[tuple[str, list[Answer], float, float]] = []
    log = Path(tempfile.mkdtemp(prefix="same-answers-")) / "serve.log"
    for restart, plan in enumerate(
        [("alone, first after a start", "bursts", "alone, warm"), ("bursts, after a restart",)]
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        limits = ["--max-concurrency", str(args.burst), "--queue-size", str(args.burst), "--request-deadline", "3600"]
        command = ["serve", "--model", args.model, "--dtype", args.dtype, "--port", str(port), *limits]
        process = start([*command, *args.serve_arg], log)
        try:
            wait_ready(url, process, log)
            with httpx.Client(base_url=url, timeout=3600) as client:
                for name in plan:
                    reads, batches = (
                        counter(client, "slotread_reads_total"),
                        counter(client, "slotread_engine_batches_total"),
                    )
                    began = time.perf_counter()
                    answers = (
                        in_bursts(client, batch, args.burst, args.seed + restart)
                        if "bursts" in name
                        else alone(client, batch)
                    )
                    elapsed = time.perf_counter() - began
                    per_batch = (counter(client, "slotread_reads_total") - reads) / max(
                        1.0, counter(client, "slotread_engine_batches_total") - batches
                    )
                    passes.append((name, answers, per_batch, elapsed))
        finally:
            stop(process)

    print(f"\n{args.model} {args.dtype}, {args.limit} SST-5 + {args.limit} BANKING77 requests, bursts of {args.burst}")
    print(f"{'pass':<28} {'max |diff|':>11} {'> 1e-6':>7} {'reads/batch':>11} {'wall s':>7}")
    reference = passes[0][1]
    for name, answers, per_batch, elapsed in passes:
        worst, differing = compare(reference, answers)
        print(f"{name:<28} {worst:>11.3g} {differing:>7} {per_batch:>11.1f} {elapsed:>7.0f}")


if __name__ == "__main__":
    main()
