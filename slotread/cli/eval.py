"""``slotread eval``: measure a model (or a baseline) on a labelled dataset; compare and tabulate runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slotread.cli.flags import (
    add_device_flags,
    add_item_flags,
    add_model_flag,
    add_progress_flag,
    add_question_flag,
    add_retrieval_flag,
    default,
    settings_of,
)
from slotread.settings import EvalSettings

#: the subcommand's line in ``slotread --help``, and the head of its own help
HELP = "measure a model (or the TF-IDF baseline) on a labelled dataset; compare runs"
USAGE = (
    "slotread eval --dataset NAME --out DIR [--model M | --baseline tfidf | --baseline knn] "
    "[--examples K] [--shortlist K] [--example-bank FILE]; "
    "slotread eval compare RUN_A RUN_B; slotread eval table RUN..."
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = commands.add_parser("eval", help=HELP, description=USAGE)
    system = evaluate.add_mutually_exclusive_group()
    add_model_flag(system, EvalSettings)
    system.add_argument(
        "--baseline",
        choices=["tfidf", "knn"],
        help="run a baseline with no model instead: tfidf (TF-IDF + logistic regression on the train split) or "
        "knn (the smoothed label vote of the --examples K nearest examples of the bank, by --retrieval)",
    )
    evaluate.add_argument("--dataset", help="banking77, clinc150, sst5, boolq, or a labelled .jsonl/.csv file")
    evaluate.add_argument("--split", help="split of a built-in dataset (default: test; boolq: dev)")
    add_question_flag(evaluate, "question file (a System One question object) for a labelled file")
    evaluate.add_argument(
        "--train",
        help="training file for baselines and example banks on a labelled file (built-ins use their train split; "
        "boolq: dev_rest); never the evaluated file",
    )
    evaluate.add_argument(
        "--per-class",
        type=int,
        metavar="K",
        help="learn from at most K training items per class (seeded by --sample-seed): the baselines, the "
        "example bank and the readout's partners see nothing else (the few-label setting)",
    )
    add_item_flags(
        evaluate,
        "evaluate",
        "an extra request field, its value JSON, e.g. x_samples=4 or x_calibration='\"contextual\"'; repeatable",
    )
    evaluate.add_argument(
        "--calibration",
        dest="calibration_dir",
        metavar="CALIBRATION",
        type=Path,
        help="directory of calibration artifacts (slotread calibrate --out) to serve",
    )
    evaluate.add_argument(
        "--readout",
        dest="readout_dir",
        metavar="READOUT",
        type=Path,
        help="directory of learned readouts (slotread fit --out) to answer with; sets x_readout=true. A readout "
        "fitted with --vote or --lexical reads the train split's bank (or --example-bank)",
    )
    evaluate.add_argument(
        "--shuffle-options",
        type=int,
        metavar="SEED",
        help="ask a choice question with its options in this seeded random order (predictions stay in class "
        "order; eval compare against the unshuffled run prints the option-order flip rate)",
    )
    evaluate.add_argument(
        "--examples",
        type=int,
        metavar="K",
        help="show each item's K nearest bank examples (by --retrieval) as solved cases (x_examples=K); with "
        "--baseline knn, the neighbours that vote. The bank is the train split (--train for a labelled file) "
        "or --example-bank",
    )
    evaluate.add_argument(
        "--shortlist",
        type=int,
        metavar="K",
        help="read at most K options, those the nearest bank examples point to (x_shortlist=K)",
    )
    evaluate.add_argument(
        "--example-bank",
        type=Path,
        metavar="FILE",
        help="example bank file (as slotread serve --example-bank takes) instead of the train split; "
        "it may hold none of the evaluated texts",
    )
    evaluate.add_argument(
        "--encoder",
        metavar="NAME",
        help="a sentence encoder (all-minilm-l6-v2): with --shortlist and no --examples/--example-bank/"
        "--retrieval dense|hybrid, the shortlist comes from meaning and no bank is built (no labels seen); with "
        "--retrieval dense|hybrid, the bank's ranking",
    )
    add_retrieval_flag(evaluate, EvalSettings, "--examples, --shortlist, --baseline knn and readouts' votes")
    add_device_flags(evaluate, EvalSettings)
    evaluate.add_argument(
        "--out", type=Path, help="run folder: run.json, predictions.csv, metrics.json, reliability.png"
    )
    evaluate.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="decisions in flight at once, their reads merged into shared engine calls as the server merges "
        f"them: faster on a GPU (default: {default(EvalSettings, 'concurrency')})",
    )
    add_progress_flag(evaluate)
    evaluate.set_defaults(run=run)
    runs = evaluate.add_subparsers(dest="eval_command")
    comparing = runs.add_parser(
        "compare", help="paired accuracy of two runs, an exact McNemar test and the flip rate (predictions that differ)"
    )
    comparing.add_argument("run_a", type=Path, help="run folder A")
    comparing.add_argument("run_b", type=Path, help="run folder B")
    comparing.set_defaults(run=run_compare)
    table = runs.add_parser("table", help="print finished runs' metrics as one Markdown table")
    table.add_argument("runs", type=Path, nargs="+", help="run folders")
    table.set_defaults(run=run_table)


def run(args: argparse.Namespace) -> int:
    from slotread.eval.evaluate import evaluate
    from slotread.eval.report import format_table

    settings = settings_of(EvalSettings, args)
    try:
        metrics = evaluate(settings)
    except KeyboardInterrupt:
        print(f"\nslotread eval: interrupted; run the same command again to resume {settings.out}", file=sys.stderr)
        return 130
    print(format_table([metrics]))
    print(f"wrote {settings.out}/metrics.json, predictions.csv and reliability.png")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from slotread.eval.report import compare, format_comparison

    print(format_comparison(compare(args.run_a, args.run_b)))
    return 0


def run_table(args: argparse.Namespace) -> int:
    from slotread.eval.report import format_table, read_metrics

    print(format_table([read_metrics(run) for run in args.runs]))
    return 0
