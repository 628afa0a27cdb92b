"""Host timeline of (d) c=32 batches: where a batch's wall time goes outside the GPU.

Each engine phase is wrapped to record when it starts and ends (host clock, ms from the batch's
start, no syncs added), Python's garbage collector is timed through ``gc.callbacks``, and on a GPU
CUDA events around the joint graph's replay say when it was enqueued and when the GPU finished it.
Prints per batch the wall time (and the replay's enqueue and finish), then per phase its calls and
its median total, start and end; and the phases of every batch over 1.15x the median wall time.
A batch is 32 decisions of 3 reads each: a 100-token state after a shared 1,500-token schema, one
16-token canvas per question (``gpu_reads.py``'s scenario (d)).

    PYTHONPATH=. python bench/host_timeline.py --batches 40   # the 26B-A4B shape on the GPU
    PYTHONPATH=. python bench/host_timeline.py --tiny         # a tiny random model on the CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from helpers import build, ids

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma import assemble, read_plan
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.prefix_cache import PrefixCache
from slotread.models.tiny import tiny_diffusion_gemma

ENGINE_PHASES = ["_check", "_encode_all", "_joint_slot_logits", "_new_tokens", "_canvases", "_head_at_slots", "_scored"]
#: the functions the engine calls through its planning and assembling modules
MODULE_PHASES = {read_plan: ["joint_chunks"], assemble: ["joint_masks", "shared_parts", "kv_entries"]}
GRAPH_PHASES = ["encode_decode", "_replay", "_capture"]
CACHE_PHASES = ["get", "put"]
REPLAY = "graphs._replay"
Span = tuple[float, float]  # start, end: ms from the batch's start


class Timeline:
    """The spans of one batch's phases, and CUDA events around its graph replay."""

    def __init__(self) -> None:
        self.origin = 0.0
        self.spans: dict[str, list[Span]] = defaultdict(list)
        self.events: dict[str, torch.cuda.Event] = {}
        self._gc_started: float | None = None
        gc.callbacks.append(self._gc)

    def now(self) -> float:
        return (time.perf_counter() - self.origin) * 1e3

    def start(self) -> None:
        self.spans.clear()
        self.events.clear()
        self.origin = time.perf_counter()

    def wrap(self, owner: object, name: str, label: str) -> None:
        method: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = self.now()
            if label == REPLAY:
                self._record("enqueued")
            result = method(*args, **kwargs)
            if label == REPLAY:
                self._record("done")
            self.spans[label].append((begin, self.now()))
            return result

        setattr(owner, name, timed)

    def _record(self, name: str) -> None:
        if torch.cuda.is_available():
            self.events[name] = torch.cuda.Event(enable_timing=True)
            self.events[name].record()

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = self.now()
        elif self._gc_started is not None:
            self.spans[f"gc (generation {info['generation']})"].append((self._gc_started, self.now()))
            self._gc_started = None


def decisions(generator: torch.Generator, schema: tuple[int, ...]) -> list[ReadRequest]:
    states = [ids(generator, 100) for _ in range(32)]
    return [
        ReadRequest((schema, state), ids(generator, 16), (Slot(8, ids(generator, 8)),), seed=3 * k + q)
        for k, state in enumerate(states)
        for q in range(3)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    model = tiny_diffusion_gemma() if args.tiny else build(30, torch.bfloat16)
    engine = DiffusionGemmaEngine(
        model, prefix_cache=PrefixCache(40 * 2**30), max_canvases=128, max_encode_tokens=16384
    )
    schema = ids(generator, 1500)
    timeline = Timeline()
    for name in ENGINE_PHASES:
        timeline.wrap(engine, name, name)
    for module, names in MODULE_PHASES.items():
        for name in names:
            timeline.wrap(module, name, module.__name__.rsplit(".", 1)[-1] + "." + name)
    if engine._graphs is not None:
        for name in GRAPH_PHASES:
            timeline.wrap(engine._graphs, name, "graphs." + name)
    for name in CACHE_PHASES:
        timeline.wrap(engine.prefix_cache, name, "cache." + name)

    for _ in range(3):  # warm: compiles, and each bucket's graph is captured on its second use
        engine.read(decisions(generator, schema))
    batches: list[tuple[float, dict[str, float], dict[str, list[Span]]]] = []
    for _ in range(args.batches):
        batch = decisions(generator, schema)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timeline.start()
        begin = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else None
        if begin is not None:
            begin.record()
        engine.read(batch)
        wall = timeline.now()
        gpu = {}
        if begin is not None:
            torch.cuda.synchronize()
            gpu = {name: begin.elapsed_time(event) for name, event in timeline.events.items()}
        batches.append((wall, gpu, dict(timeline.spans)))

    walls = [wall for wall, _, _ in batches]
    print("wall ms", [round(wall, 1) for wall in walls])
    if any(gpu for _, gpu, _ in batches):
        print("replay enqueued / done ms", [(round(g["enqueued"], 1), round(g["done"], 1)) for _, g, _ in batches if g])
    print("phase | calls | median total ms | median start | median end")
    for label in dict.fromkeys(label for _, _, spans in batches for label in spans):
        seen = [spans[label] for _, _, spans in batches if label in spans]
        totals = [sum(end - start for start, end in s) for s in seen]
        starts, ends = [s[0][0] for s in seen], [s[-1][1] for s in seen]
        print(
            f"{label} | {len(seen[0])} ({len(seen)} of {len(batches)} batches) | {statistics.median(totals):.2f}"
            f" | {statistics.median(starts):.2f} | {statistics.median(ends):.2f}"
        )
    limit = 1.15 * statistics.median(walls)
    for index, (wall, gpu, spans) in enumerate(batches):
        if wall > limit:
            print(f"batch {index}: {wall:.1f} ms", {name: round(ms, 1) for name, ms in gpu.items()})
            for label, span in spans.items():
                total = sum(end - start for start, end in span)
                print(f"   {label} | {len(span)} | {total:.2f} | {span[0][0]:.2f} | {span[-1][1]:.2f}")


if __name__ == "__main__":
    main()
