"""Failover under load: ``slotread serve --upstream`` in front of real ``slotread engine`` replicas, with
replicas killed, stopped and restarted while clients post decisions.

    PYTHONPATH=. python bench/failover.py                                   # 2 replicas, 32 clients, 320 decisions
    PYTHONPATH=. python bench/failover.py --kill-at 3                       # replica 1 SIGKILLed 3 s in
    PYTHONPATH=. python bench/failover.py --clients 8 --decisions 200 --kill-at 3 --busy 6   # a loaded machine
    PYTHONPATH=. python bench/failover.py --stop-at 3 --stop-for 10         # SIGSTOP for 10 s, then SIGCONT
    PYTHONPATH=. python bench/failover.py --soak 600 --kill-every 60        # the soak: a kill (and restart) a minute

Starts ``--replicas`` ``slotread engine`` processes of ``--model`` (SmolLM2 on the CPU by default) and a
gateway, ``slotread serve --model M --upstream ...`` with its own defaults, each a process of its own; waits
for ``/readyz``; then ``--clients`` workers in this process post two-question decisions (README's support
questions about varied messages) back to back. Like the official SDK a worker gives a try 10 s and
tries a decision up to three times within 30 s, resending it after the ``retry-after-ms`` of a 429, 503
or 529; anything else (another status, a connection dropped, a try past 10 s) ends the decision. ``--busy N``
keeps N busy-looping processes running through the phase: a loaded machine (a 2-core machine with N = 6
sits at a load average of about 9, as the machine the failures were first seen on).

Prints one row for the phase (decisions answered 200, the statuses every try got, latency of the
answered ones), and for ``--soak`` the answered decisions per second, p99 and statuses in windows of
``--window`` seconds, and before/during/after each kill (during: from the kill until the restarted
replica is back in the gateway's rotation; before and after: as long, either side).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from helpers import SUPPORT_MESSAGES, TICKET_QUESTIONS, free_port, percentile, start, stop, wait_ready

MESSAGES = [
    *SUPPORT_MESSAGES,
    "I moved house last month. Where do I update my address so the new card goes to the right place?",
    "Why was my transfer to my landlord declined? I have enough money in the account.",
]
QUESTIONS = {name: TICKET_QUESTIONS[name] for name in ("urgent", "intent")}
#: statuses after which a client waits retry-after and sends the decision again
RETRIED = {429, 503, 529}
#: what the official SDK gives one try, how many tries a decision gets, and its budget for all of them
#: (it gives up before a retry whose wait would reach it)
TRY_TIMEOUT_S = 10.0
TRIES = 3
BUDGET_S = 30.0


def state(rng: random.Random) -> str:
    """A ticket of one to three messages: states of about 15 to 70 words, each ticket its own."""
    return f"Ticket {rng.randrange(10**6)}: " + " ".join(rng.sample(MESSAGES, rng.randint(1, 3)))


@dataclass
class Decision:
    """One decision as its client saw it: when it was sent and ended (seconds into the phase), what
    each try got, and the latency of the last try."""

    sent: float
    ended: float = 0.0
    tries: list[str] = field(default_factory=list)
    #: why each refusal came: the start of its message
    refusals: list[str] = field(default_factory=list)
    #: the retry-after of each refusal
    waits: list[float] = field(default_factory=list)
    #: a retried status without retry-after
    bare_refusals: int = 0

    @property
    def status(self) -> str:
        return self.tries[-1]


@dataclass
class Timeline:
    """What happened to the replicas, and when (seconds into the phase)."""

    events: list[tuple[float, str]] = field(default_factory=list)
    #: (time, replicas the gateway has in rotation), sampled from /readyz
    rotation: list[tuple[float, set[str]]] = field(default_factory=list)


class Replicas:
    """The ``slotread engine`` processes, each on a port it keeps across restarts."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        self.ports = [free_port() for _ in range(args.replicas)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * args.replicas
        self.starts = [0] * args.replicas

    def start(self, index: int) -> None:
        self.starts[index] += 1
        command = ["engine", "--model", self.args.model, "--port", str(self.ports[index]), "--dtype", self.args.dtype]
        log = self.folder / f"engine-{index}-{self.starts[index]}.log"
        self.processes[index] = start(command, log)

    def wait(self, index: int) -> None:
        process = self.processes[index]
        assert process is not None
        log = self.folder / f"engine-{index}-{self.starts[index]}.log"
        wait_ready(self.urls[index], process, log, "/healthz")

    def signal(self, index: int, sig: signal.Signals) -> None:
        process = self.processes[index]
        assert process is not None
        os.killpg(process.pid, sig)
        if sig == signal.SIGKILL:
            process.wait()

    def stop_all(self) -> None:
        for process in self.processes:
            if process is not None:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGCONT)
                stop(process)


async def client(
    http: httpx.AsyncClient, rng: random.Random, started: float, until: Any, decisions: list[Decision]
) -> None:
    """Post decisions back to back while ``until()`` says to go on."""
    while until():
        body = {"state": state(rng), "questions": QUESTIONS}
        decision = Decision(time.monotonic() - started)
        decisions.append(decision)
        for attempt in range(TRIES):
            try:
                response = await http.post("/v1/systemone", json=body)
            except httpx.TimeoutException:
                decision.tries.append("timed out")
                break
            except httpx.HTTPError as exc:
                decision.tries.append(f"dropped ({type(exc).__name__})")
                break
            decision.tries.append(str(response.status_code))
            if response.status_code != 200:
                decision.refusals.append(f"{response.status_code} {refusal(response)}")
            if response.status_code not in RETRIED or attempt == TRIES - 1:
                break
            wait_ms = response.headers.get("retry-after-ms")
            if wait_ms is None:
                decision.bare_refusals += 1
            wait = float(wait_ms or 1000) / 1000
            decision.waits.append(wait)
            if time.monotonic() - started - decision.sent + wait >= BUDGET_S:
                break
            await asyncio.sleep(wait)
        decision.ended = time.monotonic() - started


def refusal(response: httpx.Response) -> str:
    """A refusal's reason in a few words: its message up to the first number or colon."""
    try:
        message = str(response.json()["detail"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:40]
    return re.split(r"[0-9(:]", message, maxsplit=1)[0].strip()


async def watch(gateway: str, started: float, timeline: Timeline, done: asyncio.Event) -> None:
    """Sample the gateway's rotation every 0.25 s."""
    async with httpx.AsyncClient(base_url=gateway, timeout=2.0) as http:
        while not done.is_set():
            try:
                states = (await http.get("/readyz")).json().get("upstreams", {})
                up = {url for url, state in states.items() if state == "up"}
                timeline.rotation.append((time.monotonic() - started, up))
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.25)


async def faults(args: argparse.Namespace, replicas: Replicas, started: float, timeline: Timeline) -> None:
    """The faults the flags ask for, at their times."""

    def at(event: str) -> None:
        timeline.events.append((time.monotonic() - started, event))

    async def sleep_until(moment: float) -> None:
        await asyncio.sleep(max(0.0, started + moment - time.monotonic()))

    if args.kill_at is not None:
        await sleep_until(args.kill_at)
        replicas.signal(1, signal.SIGKILL)
        at("kill 1")
    if args.stop_at is not None:
        await sleep_until(args.stop_at)
        replicas.signal(1, signal.SIGSTOP)
        at("stop 1")
        await sleep_until(args.stop_at + args.stop_for)
        replicas.signal(1, signal.SIGCONT)
        at("cont 1")
    if args.soak:
        victim, moment = 0, float(args.kill_every)
        while moment + args.down_for < args.soak:
            await sleep_until(moment)
            replicas.signal(victim, signal.SIGKILL)
            at(f"kill {victim}")
            await sleep_until(moment + args.down_for)
            replicas.start(victim)
            at(f"restart {victim}")
            victim, moment = (victim + 1) % args.replicas, moment + args.kill_every


async def phase(args: argparse.Namespace, gateway: str, replicas: Replicas) -> tuple[list[Decision], Timeline, float]:
    decisions: list[Decision] = []
    timeline = Timeline()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    started = time.monotonic()
    if args.soak:

        def until() -> bool:
            return time.monotonic() - started < args.soak

    else:

        def until() -> bool:
            return len(decisions) < args.decisions

    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=gateway, timeout=TRY_TIMEOUT_S, limits=limits) as http:
        watcher = asyncio.create_task(watch(gateway, started, timeline, done))
        injector = asyncio.create_task(faults(args, replicas, started, timeline))
        workers = [client(http, random.Random(index), started, until, decisions) for index in range(args.clients)]
        await asyncio.gather(*workers)
        elapsed = time.monotonic() - started
        done.set()
        injector.cancel()
        await watcher
    return decisions, timeline, elapsed


def summary(decisions: list[Decision], seconds: float) -> tuple[str, ...]:
    """answered, statuses of every try, p50, p99, max latency of the answered, answered per second."""
    answered = [d for d in decisions if d.status == "200"]
    tries = collections.Counter(status for d in decisions for status in d.tries)
    latencies = [1000 * (d.ended - d.sent) for d in answered]
    statuses = ", ".join(f"{status}: {count}" for status, count in sorted(tries.items()))
    return (
        f"{len(answered)} of {len(decisions)}",
        statuses,
        f"{percentile(latencies, 0.5):.0f}",
        f"{percentile(latencies, 0.99):.0f}",
        f"{max(latencies, default=float('nan')):.0f}",
        f"{len(answered) / seconds:.2f}",
    )


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


HEADER = ("decisions answered 200", "statuses of every try", "p50 ms", "p99 ms", "max ms", "answered/s")


def back_in_rotation(timeline: Timeline, url: str, after: float) -> float | None:
    """When ``url`` was first seen in rotation after ``after`` (past the kill's own drop out)."""
    left = next((t for t, up in timeline.rotation if t > after and url not in up), None)
    if left is None:
        return None
    return next((t for t, up in timeline.rotation if t > left and url in up), None)


def soak_report(decisions: list[Decision], timeline: Timeline, replicas: Replicas, args: argparse.Namespace) -> str:
    windows = []
    for begin in range(0, int(args.soak), args.window):
        inside = [d for d in decisions if begin <= d.ended < begin + args.window]
        kills = ", ".join(event for moment, event in timeline.events if begin <= moment < begin + args.window)
        _, statuses, _, p99, _, per_second = summary(inside, args.window)
        windows.append((f"{begin}-{begin + args.window}", per_second, p99, statuses, kills))
    around = []
    for moment, event in timeline.events:
        if not event.startswith("kill"):
            continue
        victim = replicas.urls[int(event.split()[1])]
        back = back_in_rotation(timeline, victim, moment) or moment + args.down_for
        span = back - moment
        for name, begin, end in (
            ("before", moment - span, moment),
            ("during", moment, back),
            ("after", back, back + span),
        ):
            inside = [d for d in decisions if begin <= d.sent < end]
            _, statuses, _, p99, _, _ = summary(inside, span)
            share = f"{sum(d.status == '200' for d in inside) / max(1, len(inside)):.1%}"
            around.append((f"{event} at {moment:.0f} s", name, f"{begin:.0f}-{end:.0f}", share, p99, statuses))
    header = ("seconds", "answered/s", "p99 ms", "statuses of every try", "events")
    return (
        table(header, windows)
        + "\n\n"
        + table(("kill", "phase", "seconds", "answered 200", "p99 ms", "statuses of every try"), around)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--decisions", type=int, default=320, help="decisions to send (not with --soak)")
    parser.add_argument("--kill-at", type=float, help="SIGKILL replica 1 this many seconds in (not restarted)")
    parser.add_argument("--stop-at", type=float, help="SIGSTOP replica 1 this many seconds in")
    parser.add_argument("--stop-for", type=float, default=10.0, help="then SIGCONT it after this long")
    parser.add_argument("--soak", type=float, default=0.0, help="hold the load this many seconds instead")
    parser.add_argument("--kill-every", type=float, default=60.0, help="soak: SIGKILL a replica this often")
    parser.add_argument("--down-for", type=float, default=5.0, help="soak: restart it after this long")
    parser.add_argument("--window", type=int, default=30, help="soak: seconds per row of the timeline")
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes through the phase")
    parser.add_argument("--gateway-arg", action="append", default=[], help="an extra slotread serve argument")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="slotread-failover-"))
    replicas = Replicas(args, folder)
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    busy: list[subprocess.Popen[bytes]] = []
    server = None
    try:
        for index in range(args.replicas):
            replicas.start(index)
        for index in range(args.replicas):
            replicas.wait(index)
        command = ["serve", "--model", args.model, "--port", str(port), *args.gateway_arg]
        for url in replicas.urls:
            command += ["--upstream", url]
        server = start(command, folder / "gateway.log")
        wait_ready(gateway, server, folder / "gateway.log")
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        decisions, timeline, seconds = asyncio.run(phase(args, gateway, replicas))
        load = os.getloadavg()[0]
    finally:
        for process in busy:
            process.kill()
        if server is not None:
            stop(server)
        replicas.stop_all()

    faults = ", ".join(f"{event} at {moment:.1f} s" for moment, event in timeline.events) or "none"
    print(
        f"{args.model} ({args.dtype}), {args.replicas} replicas behind slotread serve --upstream, "
        f"{args.clients} clients, {len(decisions)} decisions in {seconds:.1f} s; faults: {faults}; "
        f"{args.busy} busy processes, load average {load:.1f} at the end; logs in {folder}\n"
    )
    print(table(HEADER, [summary(decisions, seconds)]))
    bare = sum(d.bare_refusals for d in decisions)
    reasons = collections.Counter(reason for d in decisions for reason in d.refusals)
    print(f"\nretried statuses without retry-after: {bare}")
    for reason, count in reasons.most_common():
        print(f"{count} x {reason}")
    if args.soak:
        print()
        print(soak_report(decisions, timeline, replicas, args))


if __name__ == "__main__":
    main()
