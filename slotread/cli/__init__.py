"""The ``slotread`` command: one module per subcommand, each parsing its flags into Settings, calling the
Python API and printing what it returns.

Exit codes: 0 success, 2 invalid request (the 422 detail on stderr), 1 anything else (a setting out of
range or settings that cannot work together: ``slotread <command>: ...``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from slotread.cli import calibrate, decide, engine, fit, models, serve
from slotread.cli import eval as evaluate
from slotread.cli.flags import add_common_flags, add_common_flags_to_subcommands
from slotread.errors import InvalidRequest, SettingsError, SlotreadError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="slotread", description=__doc__)
    add_common_flags(parser, None)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (decide, serve, calibrate, fit, engine, models, evaluate):
        command.add_parser(commands)
    add_common_flags_to_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(args.log_level or "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("slotread").setLevel((args.log_level or "INFO").upper())
    try:
        code: int = args.run(args)
    except InvalidRequest as exc:
        print(json.dumps({"detail": exc.detail}, ensure_ascii=False, indent=2), file=sys.stderr)
        return 2
    except SettingsError as exc:
        print(f"slotread {args.command}: {exc}", file=sys.stderr)
        return 1
    except SlotreadError as exc:
        print(f"slotread: {exc}", file=sys.stderr)
        return 1
    return code
