"""Where a running server's host CPU goes: py-spy samples of its threads, summarised.

``record`` attaches py-spy (``pip install py-spy``) to a process for a while: 200 samples a second,
raw folded stacks (one line per distinct stack, its sample count at the end), one file of the threads
that are not idle and, with ``gil``, one of the thread that holds the GIL (what a GIL-bound server
waits on). py-spy reads the process's memory from outside, so it sees threads running C code (torch
with the GIL released) too. ``summary`` turns such a file into a short table: per thread (numbered
names folded into one, ``slotread-decide_*``) its samples as cores kept busy, then the functions
holding the most samples, inclusive and self (keyed by name and file, counted once per stack).

    PYTHONPATH=. python bench/stack_profile.py PROFILE.txt --seconds 8   # summarise a recorded file
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

RATE = 200  # samples per second


def record(pid: int, seconds: float, out: Path, gil: bool = False) -> subprocess.Popen[bytes]:
    """Start py-spy on ``pid`` for ``seconds`` (``gil``: the GIL holder's stacks only), writing folded
    stacks to ``out``; wait on the returned process."""
    binary = shutil.which("py-spy")
    if binary is None:
        raise SystemExit("--profile needs py-spy on the PATH (pip install py-spy)")
    command = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
    command += ["--rate", str(RATE), "--threads", "--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen([*command, *(["--gil"] if gil else [])], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _thread(frame: str) -> str:
    """``thread (0x7f..): slotread-decide_7`` -> ``slotread-decide_*``."""
    name = frame.split(":", 1)[1].strip() if ":" in frame else frame
    return re.sub(r"\d+$", "*", name) or "?"


def _function(frame: str) -> str:
    """``read (slotread/engines/base.py:120)`` -> ``read (engines/base.py)``."""
    match = re.match(r"^(.*) \((.*?)(?::\d+)?\)$", frame)
    return f"{match[1]} ({'/'.join(Path(match[2]).parts[-2:])})" if match else frame


def summary(path: Path, seconds: float, top: int = 25) -> str:
    """The table ``record``'s file gives: threads, then the top functions inclusive and self."""
    threads: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples, frames = int(count), stack.split(";")
        total += samples
        threads[_thread(frames[0])] += samples
        functions = [_function(frame) for frame in frames[1:]]
        for function in set(functions):
            inclusive[function] += samples
        if functions:
            own[functions[-1]] += samples
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.name}: {total} samples, {total / RATE / seconds:.2f} cores on average"]
    lines += ["", "| thread | cores | share |", "|---|---:|---:|"]
    lines += [f"| {name} | {n / RATE / seconds:.2f} | {n / total:.1%} |" for name, n in threads.most_common(8)]
    for title, counts in (("inclusive", inclusive), ("self", own)):
        lines += ["", f"| function ({title}) | share |", "|---|---:|"]
        lines += [f"| {name} | {n / total:.1%} |" for name, n in counts.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="a file record() wrote")
    parser.add_argument("--seconds", type=float, required=True, help="how long it was recorded")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summary(args.profile, args.seconds, args.top))


if __name__ == "__main__":
    main()
