"""Where a server's host CPU goes: each Python thread's CPU time, charged to the stack it was in.

    python bench/stack_profile.py OUT.txt -m slotread.cli serve ...   # run a module under the sampler
    PYTHONPATH=. python bench/stack_profile.py --summary B.txt [--since A.txt] --seconds 8

Run as a wrapper, it starts a thread that every 5 ms reads each Python thread's CPU clock
(``pthread_getcpuclockid``) and its stack (``sys._current_frames``), and charges the CPU the thread
used since the last look to that stack; once a second it rewrites OUT with the totals so far (folded
stacks: ``thread;frame;...;frame milliseconds``, plus the process's whole CPU time, which also holds
native threads' such as torch's intra-op pool). CPU spent inside torch with the GIL released is
charged to the Python frame that called it, which is what a sampling profiler such as py-spy misses
when its idle detection calls such a thread idle. ``summary`` subtracts an earlier snapshot (the
start of a timed phase) and prints per thread its CPU, then the functions holding the most of it,
inclusive and self; functions are keyed by name and file, counted once per stack.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

INTERVAL_S = 0.005
PROCESS = "# process cpu ms"


def _fold(frame: FrameType | None) -> str:
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{code.co_name} ({'/'.join(Path(code.co_filename).parts[-2:])})")
        frame = frame.f_back
    return ";".join(reversed(names))


def _sample(out: Path) -> None:
    """The sampler thread: charge CPU to stacks, rewrite ``out`` once a second."""
    charged: Counter[str] = Counter()
    clocks: dict[int, float] = {}
    me = threading.get_ident()
    written = time.monotonic()
    while True:
        time.sleep(INTERVAL_S)
        frames = sys._current_frames()
        for thread in threading.enumerate():
            ident = thread.ident
            if ident is None or ident == me or ident not in frames:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, ProcessLookupError):
                continue
            used = cpu - clocks.get(ident, cpu)
            clocks[ident] = cpu
            if used > 0:
                name = re.sub(r"\d+$", "*", thread.name)
                charged[f"{name};{_fold(frames[ident])}"] += used * 1000
        if time.monotonic() - written >= 1:
            written = time.monotonic()
            lines = [f"{PROCESS} {time.process_time() * 1000:.1f}"]
            lines += [f"{stack} {ms:.3f}" for stack, ms in charged.items()]
            partial = out.with_suffix(".partial")
            partial.write_text("\n".join(lines) + "\n")
            os.replace(partial, out)


def load(path: Path) -> tuple[float, Counter[str]]:
    """A snapshot's process CPU and its charged stacks (milliseconds)."""
    process, stacks = 0.0, Counter[str]()
    if not path.exists():
        return process, stacks
    for line in path.read_text().splitlines():
        head, _, value = line.rpartition(" ")
        if head == PROCESS:
            process = float(value)
        elif head:
            stacks[head] = float(value)
    return process, stacks


def summary(now: tuple[float, Counter[str]], before: tuple[float, Counter[str]], seconds: float, top: int = 25) -> str:
    """The CPU charged between two snapshots: per thread, then the top functions, inclusive and self."""
    process = now[0] - before[0]
    threads: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, ms in now[1].items():
        ms -= before[1].get(stack, 0.0)
        if ms <= 0:
            continue
        thread, *functions = stack.split(";")
        threads[thread] += ms
        for function in set(functions):
            inclusive[function] += ms
        if functions:
            own[functions[-1]] += ms
    charged = sum(threads.values())
    if not charged:
        return "no CPU charged to Python threads"
    lines = [
        f"process CPU {process / seconds / 1000:.2f} cores over {seconds:.0f} s; Python threads "
        f"{charged / seconds / 1000:.2f} cores (the rest: native threads, such as torch's)",
        "",
        "| thread | CPU ms/s | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {ms / seconds:.0f} | {ms / charged:.1%} |" for name, ms in threads.most_common(8)]
    for title, counts in (("inclusive", inclusive), ("self", own)):
        lines += ["", f"| function ({title}) | share of thread CPU |", "|---|---:|"]
        lines += [f"| {name} | {ms / charged:.1%} |" for name, ms in counts.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "-m":
        out, module = Path(sys.argv[1]), sys.argv[3]
        sys.argv = [module, *sys.argv[4:]]
        threading.Thread(target=_sample, args=(out,), name="stack-profile", daemon=True).start()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", type=Path, required=True, help="a snapshot the sampler wrote")
    parser.add_argument("--since", type=Path, help="an earlier snapshot to subtract")
    parser.add_argument("--seconds", type=float, required=True, help="the time between the two")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    before = load(args.since) if args.since else (0.0, Counter[str]())
    print(summary(load(args.summary), before, args.seconds, args.top))


if __name__ == "__main__":
    main()
