"""Learned readouts: time of a BANKING77 fit, and what the fitted head adds to a decision's latency.

    python bench/readout.py --model smollm2-135m-instruct --per-class 4 --layout state_first schema_first \
        [--vote 24] [--lexical]

For each layout: fits a readout on BANKING77 train (``--per-class`` items per intent, 20% held out,
test excluded; with ``--vote K`` fused with the K-neighbour vote of the train bank, with ``--lexical``
with the TF-IDF classifier of the train bank) and prints its reading and training time and held-out
numbers; then answers ``--items`` test messages with and without ``x_readout`` (prefix cache warm)
and prints the median decision latency of each and the head's own time per answer
(``Readout.answer``, with the bank's vote and the lexical classifier's q̃ when it has them; the
classifier's fit when the readout is loaded is printed apart).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from slotread.decider import Decider
from slotread.eval.banks import bank_from_dataset
from slotread.eval.datasets import load_dataset, subset
from slotread.eval.runner import QUESTION_ID, build_request
from slotread.models.load import LoadedModel, load_model
from slotread.prompt.render import Layout
from slotread.quality.readouts.train import fit_readout


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


def bench_layout(loaded: LoadedModel, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    train = load_dataset("banking77", "train", data_dir=args.data_dir)
    test = load_dataset("banking77", "test", data_dir=args.data_dir)
    started = time.perf_counter()
    fit = fit_readout(
        Decider(loaded),
        train,
        layout=layout,
        per_class=args.per_class,
        exclude=test,
        drop_overlap=True,
        vote=args.vote,
        lexical=args.lexical,
        progress=False,
    )
    fit_seconds = time.perf_counter() - started
    bank = bank_from_dataset(train, test)
    banked = fit.readout.banked
    with tempfile.TemporaryDirectory() as directory:
        fit.readout.save(Path(directory))
        # the same weights, its own prefix cache (and the lexical classifier fitted on the bank)
        started = time.perf_counter()
        served = Decider(loaded, readout_dir=Path(directory), example_banks=[bank] if banked else [])
        load_seconds = time.perf_counter() - started
    items = subset(test, args.items, 0).items
    plain, readout, head = [], [], []
    for item in items:
        request = build_request(test.task, item, {})
        served.decide(request)  # warm the state's prefix
        started = time.perf_counter()
        served.decide(request)
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        served.decide({**request, "x_readout": True})
        readout.append(time.perf_counter() - started)
        answer = served.answer({**request, "x_readout": True}).answers[QUESTION_ID]
        assert answer is not None
        started = time.perf_counter()
        vote = bank.vote(item.state, args.vote) if args.vote else None
        lexical = served.readouts.lexical(fit.readout.schema, item.state) if args.lexical else None
        fit.readout.answer(answer, vote, lexical)
        head.append(time.perf_counter() - started)
    metrics = fit.metrics
    return {
        "layout": layout,
        "items": fit.readout.fitted_on["items"],
        "fit_s": fit_seconds,
        "load_s": load_seconds,
        "read_s_per_item": metrics["read_seconds"] / fit.readout.fitted_on["items"],
        "train_s": metrics["train_seconds"],
        "accuracy": metrics["accuracy"],
        "plain_accuracy": metrics["plain_accuracy"],
        "ece": metrics["ece"],
        "decide_ms": median_ms(plain),
        "readout_decide_ms": median_ms(readout),
        "head_ms": median_ms(head),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, checkpoint dir or .gguf")
    parser.add_argument("--per-class", type=int, default=4, help="training items per intent (default 4)")
    parser.add_argument("--items", type=int, default=20, help="test messages timed (default 20)")
    parser.add_argument("--layout", nargs="+", default=["state_first"], help="prompt layouts to fit in")
    parser.add_argument("--vote", type=int, default=0, help="fuse the K-neighbour vote of the train bank (default 0)")
    parser.add_argument("--lexical", action="store_true", help="fuse the TF-IDF classifier of the train bank")
    parser.add_argument("--data-dir", type=Path, help="folder of the built-in datasets")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    print(
        f"{args.model}, {torch.get_num_threads()} threads, {args.device} {args.dtype}, "
        f"{args.per_class} per intent, {args.items} timed test items, vote of {args.vote} neighbours"
        f"{', lexical classifier' if args.lexical else ''}\n"
    )
    print(
        "| layout | items | fit s | load s | read s/item | train s | held-out acc (plain) | ECE "
        "| decide ms | x_readout decide ms | head (+ partners) ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layout:
        row = bench_layout(loaded, layout, args)
        print(
            f"| {row['layout']} | {row['items']} | {row['fit_s']:.0f} | {row['load_s']:.1f} "
            f"| {row['read_s_per_item']:.2f} "
            f"| {row['train_s']:.1f} | {row['accuracy']:.1%} ({row['plain_accuracy']:.1%}) | {row['ece']:.3f} "
            f"| {row['decide_ms']:.0f} | {row['readout_decide_ms']:.0f} | {row['head_ms']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
