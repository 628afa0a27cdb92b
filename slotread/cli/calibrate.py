"""``slotread calibrate``: fit one question's calibration on labelled data, print what it fitted, write it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slotread.cli.flags import add_exclusion_flags, add_item_flags, add_model_flags, add_question_flag, settings_of
from slotread.settings import CalibrateSettings

if TYPE_CHECKING:
    from slotread.quality.calibration.artifact import Calibration


#: the subcommand's line in ``slotread --help``, and the head of its own help
HELP = "fit one question's calibration (temperature, content-free reads, conformal scores) and write it"
USAGE = (
    "slotread calibrate --dataset NAME [--split S] [--limit N] [--balance] "
    "[--exclude NAME --exclude-split S] --out FILE"
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    calibrate = commands.add_parser("calibrate", help=HELP, description=USAGE)
    add_model_flags(calibrate, CalibrateSettings)
    calibrate.add_argument(
        "--dataset", required=True, help="banking77, clinc150, sst5, boolq, or a labelled .jsonl/.csv file to fit on"
    )
    calibrate.add_argument(
        "--split", help="split of a built-in dataset to fit on (e.g. train, boolq: dev_rest; default: its eval split)"
    )
    add_question_flag(calibrate, "question file (a System One question object) for a labelled file")
    add_exclusion_flags(calibrate)
    add_item_flags(
        calibrate,
        "fit on",
        "a read option the artifact is fitted under, e.g. x_permutations=4 (as slotread eval takes it)",
    )
    calibrate.add_argument(
        "--balance",
        action="store_true",
        default=None,
        help="fit on the same number of items of every class (sampled with --sample-seed after --drop-overlap, "
        "at most --limit in all), for traffic whose classes are balanced or unknown; refuses data where a class "
        "has no items. Without it --limit samples items whatever their class, keeping the data's label prior",
    )
    calibrate.add_argument("--out", type=Path, required=True, help="the artifact to write (a JSON file)")
    calibrate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slotread.decider import Decider
    from slotread.eval.datasets import balance, class_counts, load_dataset, subset
    from slotread.eval.training import drop_overlap, refuse_overlap
    from slotread.quality.calibration.train import calibrate

    settings = settings_of(CalibrateSettings, args)
    data = load_dataset(settings.dataset, settings.split, data_dir=settings.data_dir, question=settings.question)
    exclude = None
    if settings.exclude is not None:
        exclude = load_dataset(
            settings.exclude, settings.exclude_split, data_dir=settings.data_dir, question=settings.question
        )
        if settings.drop_overlap:
            data, dropped = drop_overlap(data, exclude)
            print(f"dropped {dropped} items of {settings.dataset} that also appear in the excluded data")
    data = (balance if settings.balance else subset)(data, settings.limit, settings.sample_seed)
    if exclude is not None:
        refuse_overlap(data, exclude)  # before loading the model
    decider = Decider.from_settings(settings.decider())
    fit = calibrate(decider, data, request_fields={"x_seed": settings.seed, **settings.request_fields}, exclude=exclude)
    fit.calibration.save(settings.out)
    numbers = fit.summary()
    each_class = min(class_counts(data).values()) if data.balanced else None
    print(
        CalibrateReport(
            fit.calibration, numbers["accuracy"], numbers["nll_raw"], numbers["nll_fitted"], each_class, settings.out
        )
    )
    return 0


@dataclass(frozen=True)
class CalibrateReport:
    """What ``slotread calibrate`` prints: the artifact, its in-sample numbers and where it went."""

    calibration: Calibration
    #: the raw answers' accuracy, and their NLL before (T = 1) and after the fitted temperature
    accuracy: float
    nll_raw: float
    nll_fitted: float
    #: items of each class, when the data was balanced
    each_class: int | None
    out: Path

    def __str__(self) -> str:
        calibration = self.calibration
        ece = calibration.fitted_on["ece"]
        balanced = "" if self.each_class is None else f" ({self.each_class} of each class)"
        return (
            f"{calibration.model}, schema {calibration.schema[:16]}, {calibration.fitted_on['items']} items{balanced}: "
            f"temperature {calibration.temperature:.4f} (NLL {self.nll_raw:.4f} -> {self.nll_fitted:.4f}, "
            f"raw accuracy {self.accuracy:.1%}); content-free shifts {sorted(calibration.content_free)}; "
            f"in-sample ECE {ece['contextual']:.3f} contextual -> {ece['binned']:.3f} binned "
            f"({len(calibration.bins.values) if calibration.bins else 0} bins); wrote {self.out}"
        )
