"""The real server on a loopback port, and an engine wrapper that holds reads until a test lets them go."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from slotread.decider import Decider
from slotread.engines.base import Engine, ReadRequest, SlotScores
from slotread.engines.thought import ThoughtRequest
from slotread.models.load import LoadedModel


@dataclass
class Live:
    """A running server: its base URL, its app and the uvicorn server (to stop it)."""

    url: str
    app: FastAPI
    server: uvicorn.Server

    def client(self, **options: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=options.pop("timeout", 60.0), **options)


@contextmanager
def live_server(app: FastAPI, ready: bool = True) -> Iterator[Live]:
    """Serve ``app`` with uvicorn in a background thread on a free loopback port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", ws="none", http="h11", timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = Live(f"http://127.0.0.1:{port}", app, server)
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    if ready:
        with live.client() as client:
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the server did not get ready"
                time.sleep(0.02)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


class HeldEngine:
    """An Engine that wraps a real one and holds every read until ``release`` is set.

    ``entered`` is set when a read has started, so a test knows the model is busy.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.family = engine.family
        self.noisy = engine.noisy
        self.deterministic = engine.deterministic
        self.max_tokens = engine.max_tokens
        self.entered = threading.Event()
        self.release = threading.Event()

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.entered.set()
        assert self.release.wait(60), "the test never released the engine"
        return self.engine.read(requests)

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """The wrapped engine's thoughts, not held."""
        thoughts: list[tuple[int, ...]] = self.engine.think(requests)  # type: ignore[attr-defined]
        return thoughts


class ThreadsSeen:
    """An Engine that wraps a real one and notes the thread of every call."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.family, self.noisy = engine, engine.family, engine.noisy
        self.deterministic, self.max_tokens = engine.deterministic, engine.max_tokens
        self.threads: list[int] = []

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.threads.append(threading.get_ident())
        return self.engine.read(requests)

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        self.threads.append(threading.get_ident())
        thoughts: list[tuple[int, ...]] = self.engine.think(requests)  # type: ignore[attr-defined]
        return thoughts


def held_decider(loaded: LoadedModel, **limits: Any) -> tuple[Decider, HeldEngine]:
    """A Decider on ``loaded`` whose reads wait for ``HeldEngine.release``."""
    decider = Decider(loaded, **limits)
    held = HeldEngine(decider.engine)
    decider.engine = held
    return decider, held
