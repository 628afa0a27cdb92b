"""A running server's engine calls, replayed alone: are the calls slow, or does the server slow them?

``bench/serve_load.py --replay N`` starts each process that runs an engine (``slotread serve``, or the
gateway's ``slotread engine`` replicas) through this module, which keeps the last 2N engine calls (the
batcher's ``_read``, in the engine's thread: the reads and the call's time in the server) and then runs
the CLI. When a file ``REC.dump`` appears (the client creates it as its timed phase ends), a watcher
thread pickles them to REC. Once the server has stopped (its device memory free), ``replay`` loads the
model in the benchmark's process and reads the recorded calls in the server's order, each call whole:
the same reads in the same batches on the same prefix-cache contents, without the server around them
(its HTTP, decision threads, batcher). The pass runs three times from an empty cache, so every graph
bucket the calls ask for is captured before the timed pass; in that pass the first N calls warm the
cache (the shared instructions) and the last N are timed against their time in the server.

    python bench/call_replay.py N REC -m slotread.cli serve ...   # what serve_load runs
"""

from __future__ import annotations

import pickle
import runpy
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slotread.serve.batcher import BatchingEngine

Read = Callable[[BatchingEngine, list[Any]], list[Any]]
#: a recorded call: its reads and its seconds in the server
Call = tuple[list[Any], float]


class CallRecorder:
    """Keeps the last ``2 * calls`` read calls of every batcher and pickles them to ``recording``
    whenever ``recording.dump`` appears (polled by a thread of its own: the engine's calls never wait
    for the file)."""

    def __init__(self, calls: int, recording: Path) -> None:
        self.recording = recording
        self.trigger = recording.with_suffix(".dump")
        self._kept: deque[Call] = deque(maxlen=2 * calls)
        threading.Thread(target=self._watch, daemon=True, name="call-recorder").start()

    def wrap(self, read: Read) -> Read:
        def recorded(batcher: BatchingEngine, requests: list[Any]) -> list[Any]:
            started = time.perf_counter()
            try:
                return read(batcher, requests)
            finally:
                self._kept.append((list(requests), time.perf_counter() - started))

        return recorded

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            if self.trigger.exists():
                self.trigger.unlink()
                partial = self.recording.with_suffix(".part")
                partial.write_bytes(pickle.dumps(list(self._kept)))
                partial.rename(self.recording)  # whole or absent: the benchmark waits for the name


def replay(engine: Any, recording: Path, device: str) -> tuple[int, list[int], float, float, int]:
    """The recorded calls' replay on ``engine``: (calls timed, their reads in order, median ms in the
    server, median ms alone, graph captures in the timed pass)."""
    calls: list[Call] = pickle.loads(recording.read_bytes())
    half = len(calls) // 2

    def call(requests: list[Any]) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine.read(requests)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    graphs = getattr(engine, "_graphs", None)
    for _ in range(2):  # each bucket asked for twice: captured (graphs.py captures on the second ask)
        engine.prefix_cache.clear()
        for requests, _ in calls:
            call(requests)
    engine.prefix_cache.clear()
    for requests, _ in calls[:half]:
        call(requests)
    captures = graphs.captures if graphs is not None else 0
    alone = [call(requests) for requests, _ in calls[half:]]
    captures = (graphs.captures if graphs is not None else 0) - captures
    reads = [len(requests) for requests, _ in calls[half:]]
    server = statistics.median(took for _, took in calls[half:])
    return len(alone), reads, server * 1e3, statistics.median(alone) * 1e3, captures


def main() -> None:
    calls, recording = int(sys.argv[1]), Path(sys.argv[2])
    BatchingEngine._read = CallRecorder(calls, recording).wrap(BatchingEngine._read)  # type: ignore[method-assign]
    if sys.argv[3:4] != ["-m"]:
        raise SystemExit("usage: call_replay.py CALLS RECORDING -m MODULE [ARGS...]")
    sys.argv = [sys.argv[4], *sys.argv[5:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
