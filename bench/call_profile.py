"""Torch profiles of a running server's engine calls: what the GPU does within and between them.

``bench/serve_load.py --torch-profile N`` starts each process that runs an engine (``slotread serve``,
or the gateway's ``slotread engine`` replicas) through this module, which wraps the batcher's engine
calls and then runs the CLI. A SIGUSR1 (the client sends it as its timed phase begins) arms it: the
next N read calls are profiled together, the gaps between them included (``torch.profiler``, every
thread), and a section is appended to the report file: per call its reads, the time since the
previous call ended and its own time, then the top kernels by GPU time (by CPU time off a GPU) and,
on a GPU, the busy and idle time split by the engine's phases and CUDA runtime calls
(``gpu_reads.traced`` and ``gpu_reads.idle_report``). It answers the question the engine-busy column
leaves open: when the engine is busy but slow, whether its calls wait on the GPU or on the host.

    python bench/call_profile.py CALLS REPORT -m slotread.cli serve ...   # what serve_load runs
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_reads import idle_report, traced
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from slotread.serve.batcher import BatchingEngine

Run = Callable[[BatchingEngine, list[Any]], None]


class CallProfiler:
    """Profiles ``calls`` consecutive read calls of a batcher once armed, appending each profile to
    ``report``. Engine calls run one at a time, so the state needs no lock."""

    def __init__(self, calls: int, report: Path) -> None:
        self.calls, self.report = calls, report
        self.armed = False
        self._done: threading.Event | None = None  # set to end the profiling session under way
        self._rows: list[tuple[int, float | None, float]] = []  # reads, ms since the last call ended, ms in it
        self._ended: float | None = None
        self._traced: set[int] = set()

    def arm(self, *_: object) -> None:
        self.armed = True

    def wrap(self, run: Run) -> Run:
        """``BatchingEngine._run`` profiled while armed."""

        def profiled(batcher: BatchingEngine, batch: list[Any]) -> None:
            if not self.armed or batch[0].thinks:
                return run(batcher, batch)
            if self._done is None:
                if id(batcher.engine) not in self._traced and hasattr(batcher.engine, "_graphs"):
                    traced(batcher.engine)  # a DiffusionGemma engine: its phases labelled
                    self._traced.add(id(batcher.engine))
                self._rows, self._ended = [], None
                self._session()
            started = time.perf_counter()
            try:
                run(batcher, batch)
            finally:
                since = None if self._ended is None else (started - self._ended) * 1e3
                self._ended = time.perf_counter()
                self._rows.append((sum(len(job.requests) for job in batch), since, (self._ended - started) * 1e3))
                if len(self._rows) == self.calls and self._done is not None:
                    self._done.set()
                    self._done, self.armed = None, False

        return profiled

    def _session(self) -> None:
        """Start profiling every thread, in a thread of its own (torch's profiler stops in the thread
        that started it; the engine's calls run in whichever decision thread leads them), until
        ``_done`` is set; then write the report there."""
        started, done, rows = threading.Event(), threading.Event(), self._rows
        self._done = done

        def session() -> None:
            cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
            try:
                everyone = _ExperimentalConfig(profile_all_threads=True)
                with profile(activities=activities, experimental_config=everyone) as profiled:
                    started.set()
                    done.wait()
                    if cuda:
                        torch.cuda.synchronize()
                self._write(profiled, rows)
            finally:
                started.set()  # a profiler that failed to start must not hold the engine call

        threading.Thread(target=session, name="call-profile", daemon=True).start()
        started.wait()

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
    BatchingEngine._run = profiler.wrap(BatchingEngine._run)  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, profiler.arm)
    module, sys.argv = sys.argv[4], [sys.argv[4], *sys.argv[5:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
