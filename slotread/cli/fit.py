"""``slotread fit``: fit a learned readout for one question schema, print its held-out numbers, write it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slotread.cli.flags import (
    add_exclusion_flags,
    add_item_flags,
    add_model_flags,
    add_progress_flag,
    add_question_flag,
    add_retrieval_flag,
    default,
    settings_of,
)
from slotread.settings import FitSettings

#: the subcommand's line in ``slotread --help``, and the head of its own help
HELP = "fit a learned readout (a small head on the model's slot read) for one question schema"
USAGE = (
    "slotread fit --model M (--dataset NAME [--split S] | --data FILE --questions Q.json) "
    "[--exclude NAME] --out DIR. Reads the labelled items once, trains a logistic head on the slot's "
    "hidden state and label log-probabilities, fits its temperature on a held-out share, prints the "
    "held-out accuracy and ECE, and writes <model>.<schema>.readout.json and .npz into DIR."
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fit = commands.add_parser("fit", help=HELP, description=USAGE)
    add_model_flags(fit, FitSettings)
    source = fit.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="banking77, clinc150, sst5, or a labelled .jsonl/.csv file to fit on")
    source.add_argument("--data", dest="dataset", help="a labelled .jsonl/.csv file to fit on (with --questions)")
    fit.add_argument("--split", help="split of a built-in dataset to fit on (default: train; boolq: dev_rest)")
    add_question_flag(fit, "question file (a System One question object)")
    add_exclusion_flags(fit)
    add_item_flags(fit, "fit on", "a read option of every request, e.g. x_samples=4 (as slotread eval takes it)")
    per_class, holdout = default(FitSettings, "per_class"), default(FitSettings, "holdout")
    fit.add_argument(
        "--per-class", type=int, help=f"items kept per class, drawn with --sample-seed (0: all; default {per_class})"
    )
    fit.add_argument("--holdout", type=float, help=f"share of items held out for the temperature ({holdout})")
    fit.add_argument(
        "--features",
        choices=["hidden+logits", "logits"],
        help="what the head reads: the slot's hidden state and label log-probabilities, or the latter alone "
        f"(the only choice a remote engine serves); default {default(FitSettings, 'features')}",
    )
    fit.add_argument(
        "--layout",
        choices=["schema_first", "state_first"],
        help="prompt layout of the reads (default: the family's, as plain reads: causal state_first); a causal "
        "schema_first readout caches the schema once for every state, many times cheaper on a CPU",
    )
    fit.add_argument(
        "--l2",
        type=float,
        nargs="+",
        help="L2 strengths to try; the one with the lowest held-out NLL is kept "
        f"(default {' '.join(f'{value:g}' for value in default(FitSettings, 'l2'))})",
    )
    fit.add_argument(
        "--vote",
        type=int,
        metavar="K",
        help="add the label vote of the K nearest example-bank examples to the head (weight fitted with the "
        "temperature); the readout then answers only where its bank is served (serve --example-bank; eval "
        f"builds it from the train split). Default {default(FitSettings, 'vote')}: no vote",
    )
    fit.add_argument(
        "--lexical",
        action="store_true",
        default=None,
        help="add the log-probabilities of a TF-IDF + logistic-regression classifier of the state's text, trained "
        "on the example bank of all the fitting data (weight fitted with the temperature and the vote; held-out "
        "items answered by 5-fold cross-fitting). Served only with the bank, on which the classifier is "
        "refitted when the readout is loaded",
    )
    fit.add_argument(
        "--encoder",
        metavar="NAME",
        help="add the log-probabilities of a logistic regression on this sentence encoder's embeddings "
        "(all-minilm-l6-v2) of the example bank, cross-fitted like --lexical; served with the bank and "
        "serve --encoder NAME",
    )
    add_retrieval_flag(fit, FitSettings, "--vote (dense and hybrid embed with --encoder, which also joins the head)")
    fit.add_argument(
        "--seen-per-class",
        type=int,
        metavar="K",
        help="see at most K items per class of the data at all (seeded by --sample-seed, drawn as eval "
        "--per-class K draws them): the head, the bank and the partners (the few-label setting); "
        "--per-class then limits the head's items within them",
    )
    fit.add_argument(
        "--batch-size",
        type=int,
        help=f"items per engine call while reading (default {default(FitSettings, 'batch_size')})",
    )
    fit.add_argument("--out", type=Path, required=True, help="directory to write the readout into")
    add_progress_flag(fit)
    fit.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slotread.eval.fitting import write_readout
    from slotread.eval.training import readout_data

    settings = settings_of(FitSettings, args)
    report = write_readout(settings, readout_data(settings))
    print(report)
    if report.warning:
        print(f"slotread fit: warning: {report.warning}", file=sys.stderr)
    return 0
