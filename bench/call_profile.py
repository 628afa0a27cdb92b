"""Torch profiles of a running server's engine calls: what the GPU does within and between them.

``bench/serve_load.py --torch-profile N`` starts each process that runs an engine (``slotread serve``,
or the gateway's ``slotread engine`` replicas) through this module, which wraps the batcher's engine
calls and then runs the CLI. A file beside the report, ``REPORT.arm`` (the client creates it as its
timed phase begins), arms it: the next N read calls are profiled together, the gaps between them
included (``torch.profiler``), and a section is appended to the report file: per call its reads, the
time since the previous call ended and its own time, then the top kernels by GPU time (by CPU time off a
GPU) and, on a GPU, the busy and idle time split by the engine's phases and CUDA runtime calls
(``gpu_reads.traced`` and ``gpu_reads.idle_report``). It answers the question the engine-busy column
leaves open: when the engine is busy but slow, whether its calls wait on the GPU or on the host.

On the H200 (torch 2.11) it has given no profile yet, so ``serve_load.py`` refuses it there. Profiling
every thread from a thread of its own gave none (the server's log had Kineto's "External init callback
must run in same thread as registerClient"); profiling the batcher's engine thread stalled the server
(W1 c=32: 65 answers, then every request timed out, the process at one core). Both start CUDA
profiling off the main thread; ``bench/gpu_reads.py --profile`` profiles the engine from the main
thread and works there.

    python bench/call_profile.py CALLS REPORT -m slotread.cli serve ...   # what serve_load runs
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_reads import idle_report, traced
from torch.profiler import ProfilerActivity, profile

from slotread.serve.batcher import BatchingEngine

Read = Callable[[BatchingEngine, list[Any]], list[Any]]


class CallProfiler:
    """Profiles ``calls`` consecutive read calls of a batcher once armed, appending each profile to
    ``report``. It wraps ``BatchingEngine._read``, which runs every read call in the batcher's engine
    thread: torch's profiler records the thread that started it, and must stop there. Engine calls run
    one at a time, so the state needs no lock."""

    def __init__(self, calls: int, report: Path) -> None:
        self.calls, self.report = calls, report
        self.trigger = report.with_suffix(".arm")
        self._session: profile | None = None
        self._rows: list[tuple[int, float | None, float]] = []  # reads, ms since the last call ended, ms in it
        self._ended: float | None = None
        self._traced: set[int] = set()

    def wrap(self, read: Read) -> Read:
        """``BatchingEngine._read`` profiled once armed: the first call starts the profiler, the last
        stops it and writes the report."""

        def profiled(batcher: BatchingEngine, requests: list[Any]) -> list[Any]:
            if self._session is None:
                if not self.trigger.exists():
                    return read(batcher, requests)
                self.trigger.unlink(missing_ok=True)
                self._start(batcher)
                if self._session is None:
                    return read(batcher, requests)
            started = time.perf_counter()
            try:
                return read(batcher, requests)
            finally:
                since = None if self._ended is None else (started - self._ended) * 1e3
                self._ended = time.perf_counter()
                self._rows.append((len(requests), since, (self._ended - started) * 1e3))
                if len(self._rows) == self.calls:
                    self._stop()

        return profiled

    def _start(self, batcher: BatchingEngine) -> None:
        if id(batcher.engine) not in self._traced and hasattr(batcher.engine, "_graphs"):
            traced(batcher.engine)  # a DiffusionGemma engine: its phases labelled
            self._traced.add(id(batcher.engine))
        self._rows, self._ended = [], None
        cuda = torch.cuda.is_available()
        self._session = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
        try:
            self._session.start()
        except Exception:
            self._fail("starting torch's profiler")

    def _stop(self) -> None:
        session, self._session = self._session, None
        assert session is not None
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            session.stop()
            self._write(session, self._rows)
        except Exception:
            self._fail("stopping the profiler or summarising its events")

    def _fail(self, doing: str) -> None:
        """A section saying what failed (the benchmark prints it instead of waiting for nothing)."""
        self._session = None
        self._append([f"## no profile: {doing} failed", "", "```", traceback.format_exc(), "```"])

    def _write(self, profiled: profile, rows: list[tuple[int, float | None, float]]) -> None:
        cuda = torch.cuda.is_available()
        busy = sum(took for _, _, took in rows)
        span = busy + sum(gap or 0.0 for _, gap, _ in rows)
        lines = [
            f"## {len(rows)} engine calls: {busy:.0f} ms in calls of {span:.0f} ms ({busy / span:.0%})",
            "",
            "| call | reads | ms since the last call | ms in the call |",
            "|---:|---:|---:|---:|",
            *(
                f"| {k} | {reads} | {'-' if gap is None else f'{gap:.1f}'} | {took:.1f} |"
                for k, (reads, gap, took) in enumerate(rows)
            ),
            "",
            profiled.key_averages().table(
                sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                row_limit=24,
                max_name_column_width=60,
            ),
        ]
        if cuda:
            lines.append(idle_report(profiled.events()))
        self._append(lines)

    def _append(self, lines: list[str]) -> None:
        # whole sections only: the benchmark reads the file as soon as it exists
        before = self.report.read_text() if self.report.exists() else ""
        partial = self.report.with_suffix(".partial")
        partial.write_text(before + "\n".join(lines) + "\n\n")
        os.replace(partial, self.report)


def main() -> None:
    calls, report = int(sys.argv[1]), Path(sys.argv[2])
    if sys.argv[3] != "-m":
        raise SystemExit(__doc__)
    profiler = CallProfiler(calls, report)
    BatchingEngine._read = profiler.wrap(BatchingEngine._read)  # type: ignore[method-assign]
    module, sys.argv = sys.argv[4], [sys.argv[4], *sys.argv[5:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
