"""``slotread engine``: serve one model's slot reads over vLLM's completions API (``serve.engine_app``)."""

from __future__ import annotations

import argparse
import socket
import sys

from slotread.cli.flags import add_model_flags, add_slow_path_flag, default, settings_of
from slotread.cli.foreground import stop_cleanly, uvicorn_level
from slotread.settings import EngineSettings


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    engine = commands.add_parser("engine", help="serve a model's slot reads over vLLM's completions API")
    add_model_flags(engine, EngineSettings, required=True)
    engine.add_argument("--host", help=f"address to listen on (default {default(EngineSettings, 'host')})")
    engine.add_argument(
        "--port", type=int, help=f"port to listen on; 0 picks a free one (default {default(EngineSettings, 'port')})"
    )
    engine.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="reads bit-identical in any batch and cache state (as slotread serve --deterministic)",
    )
    add_slow_path_flag(engine)
    engine.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from slotread.serve.engine_app import ServedEngine, create_engine_app

    settings = settings_of(EngineSettings, args)
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.host, settings.port))  # a taken port fails now, not after minutes of loading
        except OSError as exc:
            print(f"slotread engine: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
            return 1
        served = ServedEngine.from_settings(settings)
        # Connections are refused until the model is loaded, then queue until uvicorn accepts them.
        sock.listen(2048)
        config = uvicorn.Config(
            create_engine_app(served), log_level=uvicorn_level(args.log_level), timeout_graceful_shutdown=30
        )
        host, port = sock.getsockname()[:2]
        print(
            f"slotread engine: {served.name} ({served.engine.family}, max_model_len {served.engine.max_tokens}) "
            f"ready on http://{host}:{port}",
            file=sys.stderr,
        )
        stop_cleanly()
        uvicorn.Server(config).run(sockets=[sock])
    return 0
