"""An engine in a process of its own, read through a pipe: the server's Python leaves its launches alone.

Python runs one thread at a time, and a GPU engine's call is ~40 ms of kernel launches, each torch call
giving the GIL up and taking it back. In one process with the server, every decision thread and the
event loop that want the GIL in the meantime make the engine's thread wait for it: on an H200 the
server's W1 calls took 1.36x as long as the same calls replayed alone, and the gateway topology
(its engine in a ``slotread engine`` process) served more than the in-process server (94 decisions/s
against 79). With the engine here they take 1.00-1.03x (bench/RESULTS.md).

``ProcessEngine`` builds the engine in a child Python (CUDA cannot be forked; ``build`` is pickled,
so a module-level function or a partial of one) and sends each call's reads down a pipe, pickled
whole (a prompt segment shared by the call's reads is pickled once); the child reads them in its
main thread and sends the scores back with the engine's counters. The child's GIL is its engine's.

Calls are one at a time (a lock; the server's ``BatchingEngine`` makes one call at a time anyway). An
exception a read raises in the child is raised again here (its type kept where it pickles). The child
exits when told to (``close``) or when the pipe closes (this process gone); if it dies, every read
raises ``EngineProcessExited``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from slotread.engines.base import Counted, Engine, Family, ImageReader, ReadRequest, SlotScores, vision_of
from slotread.engines.thought import Thinker, ThoughtRequest, can_think
from slotread.errors import NotReady

logger = logging.getLogger(__name__)

#: what the child builds: the model's name, its tokenizer (sent back pickled) and the engine
Build = Callable[[], tuple[str, Any, Engine]]


class EngineProcessExited(NotReady):
    """The engine's process is gone (killed, out of memory, a crash): nothing can be read until the
    server is restarted; its log says why the process ended. A server answers 503 and its ``/readyz``
    and ``/healthz`` say so."""


@dataclass(frozen=True)
class _Described:
    """What the parent needs to know of the child's engine: the ``Engine`` attributes and its extras."""

    name: str
    tokenizer: Any
    family: Family
    noisy: bool
    max_tokens: int
    deterministic: bool
    thinks: bool
    vision: ImageReader | None  # the engine's image preparer, which runs where the requests are parsed


class ProcessEngine:
    """An ``Engine`` (and ``Thinker``, ``Counted``) whose engine ``build`` makes in a child process.

    Waits for the build (a model's load: seconds to minutes); a failed one raises its exception here,
    as an in-process load would (its type kept where it pickles). ``name`` and ``tokenizer`` are the
    loaded model's."""

    def __init__(self, build: Build) -> None:
        ours, theirs = multiprocessing.Pipe()
        level = logging.getLogger("slotread").getEffectiveLevel()  # the CLI's --log-level
        # a fresh interpreter (CUDA cannot be forked) that imports only this module: multiprocessing's
        # spawn would import the parent's __main__ again, which a caller's unguarded script runs
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()}, {level})"],
            pass_fds=[theirs.fileno()],
        )
        self.pid = self._process.pid
        theirs.close()
        self._pipe = ours
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        try:
            described: _Described = self._call("describe", build)
        except BaseException:
            self.close()
            raise
        self.name, self.tokenizer = described.name, described.tokenizer
        self.family: Family = described.family
        self.noisy = described.noisy
        self.max_tokens = described.max_tokens
        self.deterministic = described.deterministic
        self.thinks = described.thinks
        self.vision = described.vision
        logger.info("the %s engine runs in process %d", self.name, self._process.pid)

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        scores: list[SlotScores] = self._call("read", requests)
        return scores

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        thoughts: list[tuple[int, ...]] = self._call("think", requests)
        return thoughts

    @property
    def exit_code(self) -> int | None:
        """The child's exit code once it has ended (a signal's is negative), None while it runs."""
        return self._process.poll()

    def counters(self) -> dict[str, int]:
        """The engine's counters as of its last call's end (a call under way does not hold this up)."""
        return dict(self._counters)

    def close(self) -> None:
        """Stop the child: let it finish its call and exit, else end it."""
        with self._lock:
            if self._process.poll() is None:
                with contextlib.suppress(OSError):  # the pipe is gone: the child is going too
                    self._pipe.send(("stop", None))
                try:
                    self._process.wait(10)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._pipe.close()

    def exited(self) -> str:
        """What ``EngineProcessExited`` says."""
        return f"the engine's process ended (exit code {self._process.returncode}): restart the server"

    def _call(self, kind: str, payload: Any) -> Any:
        with self._lock:
            try:
                self._pipe.send((kind, payload))
                outcome, result, counters = self._pipe.recv()
            except (EOFError, OSError) as exc:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(1)
                raise EngineProcessExited(self.exited()) from exc
        self._counters = counters
        if outcome == "raised":
            raise result
        return result


def serve(fd: int, level: int) -> None:
    """The child (``ProcessEngine`` starts it): build the engine the first message sends, then answer
    calls until told to stop or the pipe closes."""
    logging.basicConfig(format="%(levelname)s %(name)s (engine process): %(message)s")
    logging.getLogger("slotread").setLevel(level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle: it stops us
    pipe = Connection(fd)
    engine: Engine | None = None
    while True:
        try:
            kind, payload = pipe.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == "stop":
            return
        try:
            if kind == "describe":
                name, tokenizer, engine = payload()
                result: Any = _Described(
                    name,
                    tokenizer,
                    engine.family,
                    engine.noisy,
                    engine.max_tokens,
                    engine.deterministic,
                    can_think(engine),
                    _preparer(vision_of(engine)),
                )
            else:
                assert engine is not None, "described first"
                result = engine.read(payload) if kind == "read" else cast(Thinker, engine).think(payload)
            reply: tuple[str, Any] = ("done", result)
        except Exception as exc:
            reply = ("raised", _portable(exc))
        counters: dict[str, int] = engine.counters() if isinstance(engine, Counted) else {}
        try:
            pipe.send((*reply, counters))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a result that does not pickle
            pipe.send(("raised", RuntimeError(f"the engine's {kind} result could not be sent: {exc}"), counters))


def _preparer(vision: ImageReader | None) -> ImageReader | None:
    """What prepares the engine's images in the parent: its ``preparer`` if it has one (the vision
    tower, holding the model, stays in the child), else itself."""
    preparer = getattr(vision, "preparer", vision)
    return preparer if isinstance(preparer, ImageReader) else None


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives a pickle round trip, else a RuntimeError naming its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
