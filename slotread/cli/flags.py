"""The flags several subcommands share, and the one way a parsed command line becomes Settings.

A flag's ``dest`` is its Settings field's name and its argparse default is None, so ``settings_of`` passes
on what was given and nothing else: the Settings default (or the ``SLOTREAD_`` environment) fills the rest,
and help texts quote the defaults from the fields (``default``) instead of writing them again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TypeVar, get_args

from slotread.engines.diffusion_gemma.fast_paths import NAMES
from slotread.quality.examples.retrieval import RETRIEVALS
from slotread.settings import DataSettings, Dtype, ModelSettings

SettingsT = TypeVar("SettingsT", bound=ModelSettings)


def default(settings: type[ModelSettings], name: str) -> Any:
    """A Settings field's default, as the help texts quote it."""
    field = settings.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]


def settings_of(settings: type[SettingsT], args: argparse.Namespace, **given: Any) -> SettingsT:
    """``settings`` from the flags given (and ``given``); SettingsError names a bad value or combination."""
    values = {name: getattr(args, name) for name in settings.model_fields if getattr(args, name, None) is not None}
    return settings(**values, **{name: value for name, value in given.items() if value is not None})


def add_model_flags(parser: argparse.ArgumentParser, settings: type[ModelSettings], *, required: bool = False) -> None:
    """--model, --device and --dtype."""
    if required:
        parser.add_argument("--model", required=True, help="registry name, checkpoint dir or .gguf file")
    else:
        add_model_flag(parser, settings)
    add_device_flags(parser, settings)


def add_model_flag(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, settings: type[ModelSettings]
) -> None:
    """--model, defaulting to the Settings' (or $SLOTREAD_MODEL)."""
    parser.add_argument(
        "--model",
        help="registry name, checkpoint dir or .gguf file "
        f"(default: $SLOTREAD_MODEL, else {default(settings, 'model')})",
    )


def add_retrieval_flag(parser: argparse.ArgumentParser, settings: type[ModelSettings], ranks: str) -> None:
    """--retrieval: how example banks rank their examples (``quality.examples.retrieval``)."""
    parser.add_argument(
        "--retrieval",
        choices=RETRIEVALS,
        help=f"how the example bank ranks its examples for {ranks}: bm25 (words), dense (the --encoder's "
        "cosine; finds paraphrases) or hybrid (reciprocal-rank fusion of both); a readout fitted with a vote "
        f"serves only under the retrieval it was fitted with (default {default(settings, 'retrieval')})",
    )


def add_device_flags(parser: argparse.ArgumentParser, settings: type[ModelSettings]) -> None:
    """--device and --dtype."""
    parser.add_argument(
        "--device", help=f"torch device of the weights: cpu, cuda, cuda:1 (default {default(settings, 'device')})"
    )
    add_dtype_flag(parser, settings, "weights dtype")


def add_dtype_flag(parser: argparse.ArgumentParser, settings: type[ModelSettings], what: str) -> None:
    """--dtype, one of the dtypes weights load in."""
    parser.add_argument("--dtype", choices=get_args(Dtype), help=f"{what} (default: {default(settings, 'dtype')})")


def add_common_flags(parser: argparse.ArgumentParser, unset: Any) -> None:
    """--log-level and --cache-dir, which go before or after any subcommand."""
    parser.add_argument(
        "--log-level",
        default=unset,
        help="logging level (DEBUG, INFO, WARNING, ...); default: slotread's own messages (fetching, "
        "converting, loading, ready) at INFO, other libraries' at WARNING",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=unset,
        help="where fetched models are kept (default: $SLOTREAD_CACHE, else ~/.cache/slotread)",
    )


def add_common_flags_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """Every (nested) subcommand takes the common flags; given there, they win over the top level's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                add_common_flags(subparser, argparse.SUPPRESS)  # SUPPRESS: not given keeps the top level's
                add_common_flags_to_subcommands(subparser)


class _RequestField(argparse.Action):
    """``--request-field KEY=JSON``, repeatable, gathered into one dict."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, text: Any, _: Any = None
    ) -> None:
        key, sep, value = str(text).partition("=")
        if not sep or not key:
            raise argparse.ArgumentError(self, f"expected key=json, got {text!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentError(self, f"{key}: the value is not JSON ({exc.msg})") from None
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), key: parsed})


def add_item_flags(parser: argparse.ArgumentParser, verb: str, request_field_help: str) -> None:
    """The flags ``eval``, ``calibrate`` and ``fit`` share: where the items come from and how each is asked."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="folder of the built-in datasets (default: $SLOTREAD_DATA, else the copy shipped in the package)",
    )
    parser.add_argument("--limit", type=int, help=f"{verb} a seeded random sample of this many items")
    seed, sample_seed = default(DataSettings, "seed"), default(DataSettings, "sample_seed")
    parser.add_argument("--sample-seed", type=int, help=f"seed of the --limit sample (default {sample_seed})")
    parser.add_argument("--seed", type=int, help=f"x_seed of every request (default {seed})")
    parser.add_argument(
        "--request-field", dest="request_fields", action=_RequestField, metavar="KEY=JSON", help=request_field_help
    )


def add_slow_path_flag(parser: argparse.ArgumentParser) -> None:
    """--slow-path NAME, repeatable: a DiffusionGemma fast path to leave off."""
    parser.add_argument(
        "--slow-path",
        dest="slow_paths",
        action="append",
        choices=NAMES,
        metavar="NAME",
        help="leave this DiffusionGemma fast path off, reading by its reference road (to compare or debug): "
        f"one of {', '.join(NAMES)}; repeatable (the start-up log lists the fast paths on)",
    )


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """--no-progress."""
    parser.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="no progress bar")


def add_exclusion_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``calibrate`` and ``fit`` share: the evaluation data their fitting data must not hold."""
    parser.add_argument(
        "--exclude", help="the evaluation data (dataset name or labelled file): refuse to fit on items it holds"
    )
    parser.add_argument("--exclude-split", help="split of --exclude (default: its eval split)")
    parser.add_argument(
        "--drop-overlap",
        action="store_true",
        default=None,
        help="leave out the items --exclude holds instead of refusing the data "
        "(BANKING77's train split repeats 7 test messages)",
    )


def add_question_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """--question, also spelt --questions: the question file of a labelled file."""
    parser.add_argument("--question", "--questions", dest="question", type=Path, help=help)
