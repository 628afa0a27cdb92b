"""Host CPU a decision costs outside ``Engine.read``, in process (a CPU diagnostic of the front door).

Each decision goes the server's way without the socket: the request as JSON bytes, ``parse_json``
(``serve/body.py``), ``Decider.decide`` with its engine behind the server's ``BatchingEngine``, and
the response rendered by ``JSONResponse``. Its CPU time is the calling thread's (``time.thread_time``),
and the engine's own share is taken out: ``Engine.read`` and ``Engine.think`` are timed the same way
and subtracted, so what remains is validation, rendering and tokenising, batching, calibration and
response assembly (what a server thread holds the GIL for besides the engine). Torch runs one thread,
so the engine's work is on the calling thread too.

    PYTHONPATH=. python bench/host_cpu.py --model /tmp/tinydg --workloads w1,w1-joint,w2

prints, per workload, the non-engine and engine CPU ms per decision (mean over ``--decisions`` after
``--warmup``), one JSON line per workload with ``--json``. ``--record FILE`` writes every response
(JSON, one a line) so that two versions of the code can be checked to answer alike on the same
requests; ``--profile N`` prints cProfile's top N functions by own time over the timed decisions, the
engine's calls left out.
The requests are ``serve_load.py``'s workloads, drawn from a fixed seed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi.responses import JSONResponse
from serve_load import make_request

from slotread import Decider
from slotread.serve.batcher import BatchingEngine
from slotread.serve.body import parse_json


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workloads", default="w1,w1-joint,w2", type=lambda s: s.split(","))
    parser.add_argument("--decisions", type=int, default=20, help="timed decisions per workload")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decisions per workload first")
    parser.add_argument("--record", type=Path, help="write each timed response here, one JSON a line")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (own time)")
    parser.add_argument("--json", action="store_true", help="one JSON line per workload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    decider = Decider(args.model, device="cpu", dtype=torch.float32)
    clock = EngineClock()
    engine = decider.engine
    # instance attributes: the engine keeps its type (the batcher and pipeline check it)
    engine.read = clock.wrap(engine.read)  # type: ignore[method-assign]
    if hasattr(engine, "think"):
        engine.think = clock.wrap(engine.think)  # type: ignore[method-assign]
    decider.engine = BatchingEngine(engine)
    record = args.record.open("w") if args.record else None
    try:
        for workload in args.workloads:
            result = run_workload(decider, clock, workload, args.warmup, args.decisions, record, args.profile)
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(
                    f"{workload}: {result['host_ms']:.2f} ms host CPU outside the engine, "
                    f"{result['engine_ms']:.2f} ms in it, per decision ({args.decisions} decisions)",
                    flush=True,
                )
    finally:
        if record is not None:
            record.close()


if __name__ == "__main__":
    main()
