"""What ``serve`` and ``engine`` share: a server in the foreground, at a log level, ended by a signal."""

from __future__ import annotations

import signal


def stop_cleanly() -> None:
    """Make SIGTERM and SIGINT (Ctrl-C) end a server with exit 0 once uvicorn has shut it down.

    uvicorn catches the signal, shuts down (answering the requests in flight), restores the handler
    it found and raises the signal again: the default handlers would then exit 143, or print a
    KeyboardInterrupt traceback, after a clean shutdown. Installed just before uvicorn runs, so a
    signal during an engine's model load still stops it at once.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped)


def _stopped(signum: int, frame: object) -> None:
    """The signal uvicorn raises again after a clean shutdown: nothing left to do."""


def uvicorn_level(level: str | None) -> str:
    """uvicorn's log level: the --log-level given, else warning (no line per request)."""
    return (level or "warning").lower()
