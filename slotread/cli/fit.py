"""``slotread fit``: fit a learned readout for one question schema, print its held-out numbers, write it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from slotread.quality.readouts.readout import Readout

#: the partners whose accuracy alone ``fit_readout`` reports, in the order they are printed
ALONE = ("head", "vote", "lexical", "encoder")


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
    from slotread.decider import Decider
    from slotread.eval.datasets import BUILTIN, fitting_split, load_dataset, subset
    from slotread.eval.training import few_labels, refuse_overlap
    from slotread.quality.readouts.train import TRUSTED_ITEMS, fit_readout

    settings = settings_of(FitSettings, args)
    split = settings.split or (fitting_split(settings.dataset) if settings.dataset in BUILTIN else None)
    data = load_dataset(settings.dataset, split, data_dir=settings.data_dir, question=settings.question)
    data = subset(data, settings.limit, settings.sample_seed)
    if settings.seen_per_class:
        data = few_labels(data, settings.seen_per_class, settings.sample_seed)
    exclude = None
    if settings.exclude is not None:
        exclude = load_dataset(
            settings.exclude, settings.exclude_split, data_dir=settings.data_dir, question=settings.question
        )
        if not settings.drop_overlap:
            refuse_overlap(data, exclude)  # before loading the model
    decider = Decider.from_settings(settings.decider())
    encoder = None
    if settings.encoder:
        from slotread.models.encoder import load_encoder

        encoder = load_encoder(settings.encoder, settings.cache_dir, settings.device)
    passed = {
        *("features", "layout", "holdout", "l2", "drop_overlap"),
        *("vote", "retrieval", "lexical", "batch_size", "progress"),
    }
    fit = fit_readout(
        decider,
        data,
        per_class=settings.per_class or None,
        seed=settings.sample_seed,
        request_fields={"x_seed": settings.seed, **settings.request_fields},
        exclude=exclude,
        encoder=encoder,
        **settings.model_dump(include=passed),
    )
    report = FitReport(fit.readout, HeldOut.of(fit.metrics), fit.readout.save(settings.out))
    print(report)
    if not report.held_out.trusted:
        print(f"slotread fit: warning: {report.held_out.untrusted(TRUSTED_ITEMS)}", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class HeldOut:
    """A fitted readout's held-out numbers (``ReadoutFit.metrics``), typed."""

    items: int
    cross_fitted: bool
    trusted: bool
    accuracy: float
    accuracy_half_width: float
    #: the label softmax's, on the same items
    plain_accuracy: float
    #: with partners: the accuracy of the head and of each partner on its own, by name (``ALONE``)
    alone: dict[str, float]
    ece: float
    plain_ece: float
    nll: float
    read_seconds: float
    train_seconds: float
    #: seconds the lexical classifier's cross-fitting took (a readout with ``--lexical``)
    lexical_seconds: float | None

    @classmethod
    def of(cls, metrics: dict[str, float]) -> HeldOut:
        """The numbers ``fit_readout`` reports."""
        alone = {name: metrics[f"{name}_accuracy"] for name in ALONE if f"{name}_accuracy" in metrics}
        same = ("accuracy", "accuracy_half_width", "plain_accuracy", "ece", "plain_ece", "nll")
        return cls(
            items=int(metrics["held_out_items"]),
            cross_fitted=bool(metrics["cross_fitted"]),
            trusted=bool(metrics["trusted"]),
            alone=alone,
            read_seconds=metrics["read_seconds"],
            train_seconds=metrics["train_seconds"],
            lexical_seconds=metrics.get("lexical_seconds"),
            **{name: metrics[name] for name in same},
        )

    def __str__(self) -> str:
        alone = "".join(f", {name} alone {accuracy:.1%}" for name, accuracy in self.alone.items())
        return (
            f"held out{' (cross-fitted)' if self.cross_fitted else ''}: accuracy {self.accuracy:.1%} "
            f"± {self.accuracy_half_width:.1%} (plain read {self.plain_accuracy:.1%}{alone}), "
            f"ECE {self.ece:.3f} (plain read {self.plain_ece:.3f}), NLL {self.nll:.3f}"
        )

    def untrusted(self, trusted_items: int) -> str:
        """Why figures from too few items (fewer than ``trusted_items``) are not to be trusted."""
        return (
            f"the held-out figures rest on {self.items} items (fewer than {trusted_items}), and the temperature "
            "and weights were fitted on them: do not trust them; measure the readout with slotread eval on other data"
        )


@dataclass(frozen=True)
class FitReport:
    """What ``slotread fit`` prints: the readout, its held-out numbers, the time taken and where it went."""

    readout: Readout
    held_out: HeldOut
    path: Path

    def __str__(self) -> str:
        readout, held = self.readout, self.held_out
        weights = f"; weights: vote {readout.vote_weight:.3f}" if readout.vote_neighbours else ""
        weights += f"; lexical {readout.lexical_weight:.3f}" if readout.lexical_weight is not None else ""
        weights += f"; encoder {readout.encoder_weight:.3f}" if readout.encoder is not None else ""
        lexical = (
            ""
            if held.lexical_seconds is None
            else f" (cross-fitting the lexical classifier {held.lexical_seconds:.1f} s)"
        )
        return (
            f"{readout.model}, schema {readout.schema[:16]}, {readout.fitted_on['items']} items "
            f"({held.items} held out, {readout.fitted_on['dropped_overlap']} overlapping dropped), "
            f"{readout.layout}, features {readout.features}, L2 {readout.l2:g}, temperature {readout.temperature:.3f}\n"
            f"{held}\n"
            f"reading {held.read_seconds:.1f} s, training {held.train_seconds:.1f} s{lexical}{weights}; "
            f"wrote {self.path}"
        )
