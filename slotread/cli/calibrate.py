"""``slotread calibrate``: fit one question's calibration on labelled data, print what it fitted, write it."""

from __future__ import annotations

import argparse
from pathlib import Path

from slotread.cli.flags import add_exclusion_flags, add_item_flags, add_model_flags, add_question_flag, settings_of
from slotread.settings import CalibrateSettings

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
    from slotread.eval.fitting import write_calibration
    from slotread.eval.training import calibration_data

    settings = settings_of(CalibrateSettings, args)
    fitting = calibration_data(settings)  # refused before the model loads
    if fitting.dropped is not None:
        print(f"dropped {fitting.dropped} items of {settings.dataset} that also appear in the excluded data")
    print(write_calibration(settings, fitting))
    return 0
