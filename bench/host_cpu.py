"""Host CPU a decision costs outside ``Engine.read``, in process (a CPU diagnostic of the front door).

Each decision goes the server's way without the socket: the request as JSON bytes, ``parse_json``
(``serve/body.py``), ``Decider.decide`` with its engine behind the server's ``BatchingEngine``, and
the response rendered by ``JSONResponse``. Its CPU time is the calling thread's (``time.thread_time``),
and the engine's own share is taken out: ``Engine.read`` and ``Engine.think`` are timed the same way
and subtracted, so what remains is validation, rendering and tokenising, batching, calibration and
response assembly (what a server thread holds the GIL for besides the engine). Torch runs one thread,
so the engine's work is on the calling thread too (on a GPU: its host work, the device's time is not
CPU time).

    PYTHONPATH=. python bench/host_cpu.py --model /tmp/tinydg --workloads w1,w1-joint,w2

prints, per workload, the non-engine and engine CPU ms per decision (mean over ``--decisions`` after
``--warmup``), one JSON line per workload with ``--json``. ``--http C`` serves the same Decider
through the real app instead (``create_app``, uvicorn on 127.0.0.1 in a thread of this process, C
decisions at once) and drives it with ``serve_load.py``'s client in a separate process, C workers,
for ``--warmup`` then ``--seconds`` seconds: the process's CPU time over the timed phase (every
thread: the event loop, the decision threads, the engine's) less the engine's, per decision.
``--record FILE`` writes every response (JSON, one a line) so that two versions of the code can be
checked to answer alike on the same requests; ``--profile N`` prints cProfile's top N functions by
own time over the timed decisions, the engine's calls left out (in process only). The CPU time of a
decision moves with the machine's load: compare versions in alternating runs.
The requests are ``serve_load.py``'s workloads, drawn from a fixed seed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi.responses import JSONResponse
from helpers import free_port, poll_ready
from serve_load import make_request

from slotread import Decider
from slotread.serve.app import create_app
from slotread.serve.batcher import BatchingEngine
from slotread.serve.body import parse_json
from slotread.settings import Settings


class EngineClock:
    """Thread CPU seconds spent inside the wrapped engine methods."""

    def __init__(self) -> None:
        self.seconds = 0.0
        #: paused while the engine runs, so that it profiles the rest alone
        self.profiler: cProfile.Profile | None = None

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.profiler is not None:
                self.profiler.disable()
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started
                if self.profiler is not None:
                    self.profiler.enable()

        return timed


def decide_bytes(decider: Decider, body: bytes) -> bytes:
    """What the server does for one JSON body, the socket and the event loop left out."""
    response = decider.decide(parse_json(body))
    return bytes(JSONResponse(response).body)


def run_workload(
    decider: Decider, clock: EngineClock, workload: str, warmup: int, decisions: int, record: Any, profile: int
) -> dict[str, Any]:
    rng = random.Random(17)
    bodies = [json.dumps(make_request(workload, rng)).encode() for _ in range(warmup + decisions)]
    for body in bodies[:warmup]:
        decide_bytes(decider, body)
    profiler = clock.profiler = cProfile.Profile() if profile else None
    total = engine = 0.0
    for body in bodies[warmup:]:
        before = clock.seconds
        if profiler is not None:
            profiler.enable()
        started = time.thread_time()
        answer = decide_bytes(decider, body)
        total += time.thread_time() - started
        if profiler is not None:
            profiler.disable()
        engine += clock.seconds - before
        if record is not None:
            record.write(answer.decode() + "\n")
    clock.profiler = None
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    return {
        "workload": workload,
        "decisions": decisions,
        "host_ms": 1000 * (total - engine) / decisions,
        "engine_ms": 1000 * engine / decisions,
    }


def drive(url: str, workload: str, concurrency: int, seconds: float) -> int:
    """``serve_load.py``'s client for ``seconds``, in its own process; the decisions answered."""
    command = [sys.executable, str(Path(__file__).with_name("serve_load.py")), "client", "--url", url]
    command += ["--workload", workload, "--concurrency", str(concurrency), "--seconds", str(seconds), "--warmup", "0"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if set(result["statuses"]) != {"200"}:
        raise SystemExit(f"not every request was answered: {result['statuses']}")
    return len(result["latencies"])


def thread_cpu() -> dict[str, float]:
    """CPU seconds by kind of thread of this process, from Linux's ``/proc/self/task/TID/stat``: the
    event loop's (uvicorn's thread), the decision threads' (engine included) and the rest."""
    kinds = {thread.native_id: thread.name for thread in threading.enumerate()}
    found: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = kinds.get(int(task.name), "")
        kind = "loop" if name == "uvicorn" else "decide" if name.startswith("slotread-decide") else "other"
        found[kind] = found.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def run_http(
    decider: Decider, clock: EngineClock, workloads: list[str], concurrency: int, warmup: float, seconds: float
) -> list[dict[str, Any]]:
    """Each workload through the real app and uvicorn, this process's CPU less the engine's per decision."""
    port = free_port()
    settings = Settings(model=decider.name, max_concurrency=concurrency, queue_size=4 * concurrency, port=port)
    config = uvicorn.Config(create_app(settings, decider), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    poll_ready(url, lambda: None if thread.is_alive() else "the server thread ended", every=0.2)
    results = []
    try:
        for workload in workloads:
            drive(url, workload, concurrency, warmup)
            cpu, engine, threads = time.process_time(), clock.seconds, thread_cpu()
            decisions = drive(url, workload, concurrency, seconds)
            cpu, engine = time.process_time() - cpu, clock.seconds - engine
            after = thread_cpu()
            by_thread = {kind: 1000 * (after[kind] - threads.get(kind, 0.0)) / decisions for kind in after}
            results.append(
                {
                    "workload": workload,
                    "decisions": decisions,
                    "host_ms": 1000 * (cpu - engine) / decisions,
                    "engine_ms": 1000 * engine / decisions,
                    "thread_ms": by_thread,
                }
            )
    finally:
        server.should_exit = True
        thread.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="what slotread serve --model takes (random:DIR on a GPU)")
    parser.add_argument("--device", default="cpu", help="on a GPU the engine's CPU is its host work, launches included")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workloads", default="w1,w1-joint,w2", type=lambda s: s.split(","))
    parser.add_argument("--decisions", type=int, default=20, help="timed decisions per workload")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decisions (with --http: seconds) first")
    parser.add_argument("--record", type=Path, help="write each timed response here, one JSON a line")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (own time)")
    parser.add_argument("--json", action="store_true", help="one JSON line per workload")
    parser.add_argument("--http", type=int, default=0, help="through the app and uvicorn, this many at once")
    parser.add_argument("--seconds", type=float, default=20, help="with --http: timed seconds per workload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    decider = Decider(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    clock = EngineClock()
    engine = decider.engine
    # instance attributes: the engine keeps its type (the batcher and pipeline check it)
    engine.read = clock.wrap(engine.read)  # type: ignore[method-assign]
    if hasattr(engine, "think"):
        engine.think = clock.wrap(engine.think)  # type: ignore[method-assign]
    decider.engine = BatchingEngine(engine)
    if args.http:
        results = run_http(decider, clock, args.workloads, args.http, args.warmup, args.seconds)
    else:
        record = args.record.open("w") if args.record else None
        try:
            results = [
                run_workload(decider, clock, workload, args.warmup, args.decisions, record, args.profile)
                for workload in args.workloads
            ]
        finally:
            if record is not None:
                record.close()
    for result in results:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(
                f"{result['workload']}: {result['host_ms']:.2f} ms host CPU outside the engine, "
                f"{result['engine_ms']:.2f} ms in it, per decision ({result['decisions']} decisions)"
                + (f"; by thread (engine included) {result['thread_ms']}" if "thread_ms" in result else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
