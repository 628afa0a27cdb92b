"""``slotread serve``: build the server's Settings from the flags and the environment, then serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotread.cli.decide import ENCODER_HELP
from slotread.cli.flags import add_model_flags, add_retrieval_flag, add_slow_path_flag, default, settings_of
from slotread.cli.foreground import stop_cleanly, uvicorn_level
from slotread.models.shapes import RANDOM_PREFIX
from slotread.settings import GATEWAY_CONCURRENCY, GPU_BATCH, GPU_DEFAULTS, Settings

if TYPE_CHECKING:
    from slotread.decider import Decider


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser("serve", help="serve System One and OpenAI Decisions over HTTP")
    defaults = {name: default(Settings, name) for name in Settings.model_fields}

    def flag(name: str, help: str, **kwargs: Any) -> None:  # a help text names its defaults as {field}
        serve.add_argument(name, help=help.format(**defaults), **kwargs)

    add_model_flags(serve, Settings)
    flag(
        "--prefix-cache-mb",
        "MiB of prompt KV the engine keeps (default: 512-1024 on the CPU, half the free device memory on a GPU)",
        type=int,
    )
    flag(
        "--max-batch",
        "canvases (rows) of one forward (default on the CPU: 1 for causal models, whose answers are then "
        f"bit-identical in any batch, 16 masked, 32 DiffusionGemma; {GPU_BATCH} on a GPU)",
        type=int,
    )
    flag(
        "--deterministic",
        "answers bit-identical alone, in any burst and any cache state (answers say x_deterministic); "
        "DiffusionGemma on a GPU runs batch-invariant kernels, causal and masked models one row per forward",
        action="store_true",
        default=None,
    )
    add_slow_path_flag(serve)
    flag(
        "--engine-process",
        "run the engine in a process of its own, so the server's Python never makes its kernel launches "
        "wait (default: on a GPU, not on the CPU)",
        action=argparse.BooleanOptionalAction,
        default=None,
    )
    flag("--host", "address to listen on (default {host})")
    flag("--port", "port to listen on (default {port})", type=int)
    flag("--api-keys", "file of API keys, one key or sha256:<hex> per line; without it auth is off", type=Path)
    flag(
        "--queue-size",
        f"decisions that may wait for a slot (default {{queue_size}}; {GPU_DEFAULTS['queue_size']} on a GPU)",
        type=int,
    )
    flag(
        "--max-concurrency",
        "decisions that run at once, their reads batched together (default {max_concurrency}; "
        f"{GPU_DEFAULTS['max_concurrency']} on a GPU; {GATEWAY_CONCURRENCY} per --upstream replica)",
        type=int,
    )
    flag(
        "--request-deadline",
        "seconds within which a decision should be answered, else 529 (default {request_deadline_s:g})",
        type=float,
        dest="request_deadline_s",
        metavar="REQUEST_DEADLINE",
    )
    flag(
        "--no-playground",
        "do not serve the browser playground at /playground",
        dest="playground",
        action="store_const",
        const=False,
    )
    flag("--max-body-bytes", "request body limit, decompressed (default {max_body_bytes})", type=int)
    flag("--max-questions", "questions per request (default {max_questions})", type=int)
    flag("--max-samples", "largest x_samples (default {max_samples})", type=int)
    flag("--max-permutations", "largest x_permutations (default {max_permutations})", type=int)
    flag("--max-options", "options per choice question (default {max_options})", type=int)
    flag("--max-prompt-tokens", "tokens of one read (default: the model's limit)", type=int)
    flag(
        "--calibration",
        "directory of calibration artifacts (slotread calibrate --out); content-free reads are saved there",
        type=Path,
        dest="calibration_dir",
        metavar="CALIBRATION",
    )
    flag(
        "--readout",
        "directory of learned readouts (slotread fit --out) that requests with x_readout answer with",
        type=Path,
        dest="readout_dir",
        metavar="READOUT",
    )
    flag(
        "--example-bank",
        "example bank (JSON Lines: a header with the question, then {{state, answer}} lines; see README) "
        "serving x_examples, x_shortlist and readouts fitted with --vote or --lexical for its question schema; "
        "repeatable",
        type=Path,
        action="append",
        metavar="FILE",
        dest="example_banks",
    )
    flag("--encoder", ENCODER_HELP, metavar="NAME")
    add_retrieval_flag(serve, Settings, "x_examples, x_shortlist and readouts' votes")
    flag(
        "--upstream",
        "base URL of a slotread engine or vLLM server of --model (repeat for replicas): the server then "
        "loads only the tokenizer and sends reads there",
        action="append",
        metavar="URL",
        dest="upstreams",
    )
    flag(
        "--upstream-timeout",
        "seconds a read may wait upstream where no request deadline applies (the warm-up; requests wait "
        "until their --request-deadline) (default {upstream_timeout_s:g})",
        type=float,
        dest="upstream_timeout_s",
        metavar="UPSTREAM_TIMEOUT",
    )
    flag(
        "--health-interval",
        "seconds between health checks of each upstream (default {health_interval_s:g})",
        type=float,
        dest="health_interval_s",
        metavar="HEALTH_INTERVAL",
    )
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from slotread.decider import Decider
    from slotread.models.load import check_source
    from slotread.serve.app import create_app

    mib = args.prefix_cache_mb
    settings = settings_of(Settings, args, prefix_cache_bytes=None if mib is None else mib * 2**20)
    if settings.upstreams and "model" not in settings.model_fields_set:
        from slotread.engines.remote.engine import upstream_model

        # a gateway named no model: it serves the one its replicas serve
        adopted = upstream_model(settings.upstreams)
        settings = settings.model_copy(update={"model": adopted})
    check_source(settings.model)  # a mistyped name fails now, not after the server has started
    failed: list[BaseException] = []

    def load() -> Decider:
        try:
            return Decider.from_settings(settings)
        except BaseException as exc:
            failed.append(exc)
            server.should_exit = True  # a server that cannot load its model stops
            raise

    try:
        app = create_app(settings, load)
    except (OSError, ValueError) as exc:  # an unreadable or empty API key file
        print(f"slotread serve: {exc}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=uvicorn_level(args.log_level),
        # Stop taking connections, then give the decisions in flight this long to finish.
        timeout_graceful_shutdown=int(settings.request_deadline_s) + 30,
    )
    server = uvicorn.Server(config)
    via = f" through {len(settings.upstreams)} upstreams" if settings.upstreams else f" on {settings.device}"
    print(
        f"slotread: loading {settings.model}{via}, to serve on http://{settings.host}:{settings.port} "
        "(GET /readyz answers 200 once the model is loaded; the server stays in the foreground)",
        file=sys.stderr,
    )
    if settings.model.startswith(RANDOM_PREFIX):
        print(
            "slotread: the model's weights are random: its answers are noise (speed measurements only)", file=sys.stderr
        )
    stop_cleanly()
    server.run()
    if failed:
        print(f"slotread serve: {failed[0]}", file=sys.stderr)
        return 1
    return 0
