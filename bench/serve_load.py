"""Decisions through the front door: ``slotread serve`` as a real process, driven over HTTP.

    slotread models shape diffusion-gemma-26b-a4b --out /tmp/dg26       # config + tokenizer, no weights
    PYTHONPATH=. python bench/serve_load.py --model random:/tmp/dg26 --device cuda
    PYTHONPATH=. python bench/serve_load.py --model qwen2.5-coder-1.5b-instruct --workloads support \\
        --concurrency 1,4                                                # the CPU path

Starts the server (``--gateway``: also ``slotread engine`` behind ``slotread serve --upstream``) with
its own defaults plus ``--device``/``--dtype``, waits for ``/readyz``, then per workload and
concurrency runs a client in a separate process: C workers post decisions back to back (a 429/529 waits
its ``retry-after-ms``, as the official SDK does), first for ``--warmup`` seconds, then timed for
``--seconds``. Around the timed phase the client reads the server's ``/metrics``: the engine's prefix
cache hits and misses, prompt and canvas tokens computed, CUDA graph captures (of whole forwards and
of layer pieces), and the process's CPU time, each per decision, and how busy the engine was (its
seconds in calls over wall time) with the decisions per engine call; also the CPU time of the server's
engine process (``--engine-process``, on a GPU by default) or, behind a gateway, of the replicas
(``/proc/PID/stat``; they run on this host). ``--profile`` samples the server's (and its engine
process's or replicas') stacks with py-spy through each timed phase, busy threads and the GIL's
holder, and prints where they were (``bench/stack_profile.py``). ``--torch-profile N`` starts each process that runs an
engine through ``bench/call_profile.py`` and has it profile N engine calls from each timed phase's
start with torch's profiler: per call its reads, its time and the gap before it, the top kernels, and
where the GPU sat idle (the profiler slows the host; time and profile in separate runs; CPU only for now,
see ``bench/call_profile.py``; it profiles the process it starts, so an engine process's calls need
``SLOTREAD_ENGINE_PROCESS=false``).
``--engine-only`` then loads the model in this process and times ``Engine.read`` alone on the reads the
Decider renders for the same requests (a diagnostic).

Workloads (text is random common words; a word is about 1.3 tokens):
* ``w1``: a shared 1,500-token request-wide ``instructions``, a fresh 100-token state, a yes/no, a
  4-option choice and a 5-level score, each with its own 20-60-token instructions; ``w1-joint``: the
  same with ``x_joint: true`` (one canvas for the three);
* ``w2``: mixed traffic: three schemas (support triage with ``depends_on``/``ask_if``, a 77-option
  intent choice, a moderation schema of which a request asks its first 1-8 questions), states of
  20-400 tokens, 10% of requests with ``x_samples: "auto"``;
* ``support``: README's example questions about short support messages (the CPU path);
* ``image``: a 3-question decision (a yes/no, a 4-option colour choice, a 5-level count) about one
  fresh 512x512 PNG per request (one to four coloured squares on a plain ground, sent as System One
  ``images``) and a 10-word caption: the vision tower runs for every decision; ``image-cached``: the
  same questions about one fixed image with a fresh caption: the tower's features are kept, the
  image's tokens are still encoded with each new caption (they sit in the state's segment).
* ``w1-steps4``, ``w1-think64``: ``w1`` read after 4 denoise steps with the template pinned
  (``x_steps: 4``), or after a thought of up to 64 tokens per question (``x_think: 64``; DiffusionGemma
  writes it by block diffusion, one block of the model's canvas, up to its ``max_denoising_steps``).

The share of the bf16 peak counts 2 FLOPs per active parameter per new token (attention left out)
against ``--peak-tflops`` (788 measured on an H200 here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import stack_profile
from helpers import SUPPORT_MESSAGES, free_port, percentile, start, stop, wait_ready

WORDS = [
    "account",
    "card",
    "payment",
    "transfer",
    "balance",
    "refund",
    "branch",
    "online",
    "app",
    "customer",
    "service",
    "charge",
    "fee",
    "limit",
    "statement",
    "deposit",
    "loan",
    "rate",
    "interest",
    "phone",
    "email",
    "address",
    "password",
    "security",
    "fraud",
    "report",
    "block",
    "travel",
    "abroad",
    "currency",
    "exchange",
    "cash",
    "machine",
    "withdraw",
    "pending",
    "declined",
    "approved",
    "delay",
    "week",
    "month",
    "today",
    "tomorrow",
    "please",
    "help",
    "urgent",
    "problem",
    "issue",
    "question",
    "change",
    "update",
    "close",
    "open",
    "new",
    "old",
    "wrong",
    "missing",
    "extra",
    "twice",
    "again",
    "order",
    "delivery",
    "price",
    "team",
    "manager",
    "contract",
    "policy",
    "rule",
    "always",
    "never",
    "every",
    "should",
    "must",
    "may",
    "review",
    "record",
    "notice",
    "request",
    "reply",
]


def words(rng: random.Random, count: int) -> str:
    """``count`` random words as a sentence."""
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def paragraph(rng: random.Random, count: int) -> str:
    """About ``count`` words in sentences of 12-24."""
    sentences = []
    while count > 0:
        length = min(count, rng.randint(12, 24))
        sentences.append(words(rng, length))
        count -= length
    return " ".join(sentences)


_FIXED = random.Random(0)
POLICY = "\n".join(paragraph(_FIXED, 96) for _ in range(12))  # ~1,150 words: ~1,500 tokens
W1_QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": paragraph(_FIXED, 15)},
    "intent": {
        "type": "choice",
        "instructions": paragraph(_FIXED, 30),
        "criteria": {name: words(_FIXED, 5) for name in ("card_arrival", "refund", "lost_or_stolen", "other")},
    },
    "severity": {
        "type": "score",
        "instructions": paragraph(_FIXED, 45),
        "criteria": ["none", "low", "moderate", "high", "critical"],
    },
}
SUPPORT_INSTRUCTIONS = paragraph(_FIXED, 300)
SUPPORT_QUESTIONS: dict[str, Any] = {
    **W1_QUESTIONS,
    "escalate": {
        "type": "noul",
        "instructions": paragraph(_FIXED, 20),
        "depends_on": ["intent"],
        "ask_if": {"urgent": [True]},
    },
    "refund_due": {"type": "noul", "instructions": paragraph(_FIXED, 20), "ask_if": {"intent": ["refund"]}},
}
INTENTS = {f"{a}_{b}": words(_FIXED, 4) for a, b in zip(WORDS[:77], WORDS[40:] + WORDS[:40], strict=False)}
INTENT_INSTRUCTIONS = paragraph(_FIXED, 150)
MODERATION_INSTRUCTIONS = paragraph(_FIXED, 450)
MODERATION: list[tuple[str, dict[str, Any]]] = [
    ("spam", {"type": "noul", "instructions": paragraph(_FIXED, 12)}),
    ("abuse", {"type": "noul", "instructions": paragraph(_FIXED, 18)}),
    ("topic", {"type": "choice", "instructions": paragraph(_FIXED, 20), "criteria": {w: None for w in WORDS[:6]}}),
    ("toxicity", {"type": "score", "instructions": paragraph(_FIXED, 25), "criteria": ["none", "some", "severe"]}),
    ("personal_data", {"type": "noul", "instructions": paragraph(_FIXED, 15)}),
    ("language_ok", {"type": "noul", "instructions": paragraph(_FIXED, 10)}),
    ("tone", {"type": "score", "instructions": paragraph(_FIXED, 30), "criteria": ["hostile", "neutral", "warm"]}),
    ("needs_review", {"type": "noul", "instructions": paragraph(_FIXED, 22), "depends_on": ["abuse", "toxicity"]}),
]
README_QUESTIONS = {k: v for k, v in SUPPORT_QUESTIONS.items() if k in ("urgent", "intent", "severity")}
IMAGE_QUESTIONS: dict[str, Any] = {
    "red": {"type": "noul", "instructions": "Is there a red square in the image?"},
    "colour": {
        "type": "choice",
        "instructions": "What colour is the largest square?",
        "criteria": {"red": None, "green": None, "blue": None, "yellow": None},
    },
    "count": {"type": "score", "instructions": "How many squares are there?", "criteria": ["0", "1", "2", "3", "4"]},
}
COLOURS = [(220, 30, 30), (30, 180, 60), (40, 60, 220), (230, 210, 40)]


def square_image(rng: random.Random, size: int = 512) -> str:
    """A ``size``-pixel PNG of one to four coloured squares on a light ground, as a data URL."""
    import base64
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 4)):
        side = rng.randint(size // 10, size // 3)
        x, y = rng.randrange(size - side), rng.randrange(size - side)
        draw.rectangle((x, y, x + side, y + side), fill=rng.choice(COLOURS))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


FIXED_IMAGE = square_image(random.Random(0))


#: ``w1`` read another way (issue 20's read modes)
READ_MODES: dict[str, dict[str, Any]] = {"w1-steps4": {"x_steps": 4}, "w1-think64": {"x_think": 64}}


def make_request(workload: str, rng: random.Random) -> dict[str, Any]:
    """One request of ``workload``, fresh text from ``rng``."""
    if workload in READ_MODES:
        return {**make_request("w1", rng), **READ_MODES[workload]}
    seed = rng.randrange(2**31)
    if workload in ("w1", "w1-joint"):
        body = {"instructions": POLICY, "state": paragraph(rng, 75), "questions": W1_QUESTIONS, "x_seed": seed}
        return {**body, "x_joint": True} if workload == "w1-joint" else body
    if workload == "support":
        return {"state": rng.choice(SUPPORT_MESSAGES), "questions": README_QUESTIONS, "x_seed": seed}
    if workload in ("image", "image-cached"):
        image = FIXED_IMAGE if workload == "image-cached" else square_image(rng)
        return {"state": words(rng, 10), "images": [image], "questions": IMAGE_QUESTIONS, "x_seed": seed}
    state = paragraph(rng, rng.randint(15, 300))
    kind = rng.randrange(3)
    if kind == 0:
        body = {"instructions": SUPPORT_INSTRUCTIONS, "questions": SUPPORT_QUESTIONS}
    elif kind == 1:
        intent = {"type": "choice", "instructions": "Which topic is this message about?", "criteria": INTENTS}
        body = {"instructions": INTENT_INSTRUCTIONS, "questions": {"intent": intent}}
    else:
        body = {"instructions": MODERATION_INSTRUCTIONS, "questions": dict(MODERATION[: rng.randint(1, 8)])}
        if "needs_review" in body["questions"]:
            body["questions"] = dict(MODERATION)
    extra = {"x_samples": "auto"} if rng.random() < 0.1 else {}
    return {**body, "state": state, "x_seed": seed, **extra}


# --- the client process -----------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """The server's counters that the table divides by decisions."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(slotread_engine_\w+?)(?:_total)? ([0-9.e+-]+)$|^(process_cpu_seconds_total) (\S+)$", line)
        if match:
            name, value = (match[1], match[2]) if match[1] else (match[3], match[4])
            found[name] = float(value)
    return found


async def drive(url: str, workload: str, concurrency: int, seconds: float, seed: int) -> dict[str, Any]:
    """``concurrency`` workers posting back to back for ``seconds``: latencies, statuses, decisions."""
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    tokens: list[int] = []
    begun = time.perf_counter()
    deadline = begun + seconds
    finished: list[float] = []  # seconds into the run at which each 200 came back
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < deadline:
            body = make_request(workload, rng)
            started = time.perf_counter()
            try:
                response = await client.post(f"{url}/v1/systemone", json=body)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                continue
            statuses[str(response.status_code)] += 1
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)
                finished.append(time.perf_counter() - begun)
                tokens.append(response.json()["usage"]["input_tokens"])
            elif "retry-after-ms" in response.headers:
                await asyncio.sleep(float(response.headers["retry-after-ms"]) / 1000)

    # wait as long as the server may take to answer (its deadline, which the server inherits from the
    # same environment), and a little longer
    timeout = max(60.0, float(os.environ.get("SLOTREAD_REQUEST_DEADLINE_S", "8")) + 10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    per_second = [0] * (int(seconds) + 1)
    for at in finished:
        per_second[min(int(at), len(per_second) - 1)] += 1
    return {
        "latencies": latencies,
        "statuses": dict(statuses),
        "elapsed": elapsed,
        "tokens": tokens,
        "per_second": per_second,
    }


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` (a gateway's replicas, on this host) have used,
    from Linux's ``/proc/PID/stat`` (utime and stime, in clock ticks)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (a server's engine process, ``--engine-process``), from Linux's
    ``/proc/PID/task/TID/children``."""
    return [
        int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()
    ]


def client_main(args: argparse.Namespace) -> None:
    """Warm up, then a timed phase between two scrapes; prints one JSON line."""
    asyncio.run(drive(args.url, args.workload, args.concurrency, args.warmup, seed=1))
    before, replicas_before = scrape(args.url), cpu_seconds(args.replica_pids)
    # py-spy through the timed phase, a second short of it (it attaches while the workers start)
    spies = {}
    for name, pid in args.profile.items():
        for gil in (False, True):
            path = args.profile_to.with_name(f"{args.profile_to.name}-{name}{'-gil' if gil else ''}.txt")
            spies[path] = stack_profile.record(int(pid), args.seconds - 1, path, gil)
    for trigger in args.arm:  # ``call_profile.py``: profile the next engine calls
        trigger.touch()
    result = asyncio.run(drive(args.url, args.workload, args.concurrency, args.seconds, seed=2))
    for trigger in args.dump:  # ``call_replay.py``: write the last engine calls
        trigger.touch()
    after = scrape(args.url)
    result["profiles"] = []
    for path, spy in spies.items():
        spy.wait()
        text = stack_profile.summary(path, args.seconds - 1)
        path.with_suffix(".md").write_text(text + "\n")
        result["profiles"].append(text)
    result["counters"] = {name: after[name] - before.get(name, 0.0) for name in after}
    if args.replica_pids:
        result["counters"]["replica_cpu_seconds"] = cpu_seconds(args.replica_pids) - replicas_before
    print(json.dumps(result))


# --- the server processes and the table -------------------------------------------------------------


def row(topology: str, workload: str, concurrency: int, result: dict[str, Any], args: argparse.Namespace) -> str:
    latencies, counters = result["latencies"], result.get("counters", {})
    decisions = max(1, len(latencies))
    rate = len(latencies) / result["elapsed"]

    def per(name: str, scale: float = 1.0) -> str:
        return f"{counters[name] * scale / decisions:.1f}" if name in counters else "-"

    new = counters.get("slotread_engine_prompt_tokens", 0) + counters.get("slotread_engine_canvas_tokens", 0)
    share = new / decisions * rate * 2 * args.active_params / (args.peak_tflops * 1e12) if new else 0.0
    statuses = " ".join(f"{k}:{v}" for k, v in sorted(result["statuses"].items()))
    # how busy the in-process engine was and how many decisions an engine call merged (a gateway has none)
    busy, calls = counters.get("slotread_engine_busy_seconds"), counters.get("slotread_engine_batches")
    engine = f"{busy / result['elapsed']:.0%} / {decisions / calls:.1f}" if busy is not None and calls else "-"
    return (
        f"| {topology} | {workload} | {concurrency} | {rate:.1f} | {percentile(latencies, 0.5) * 1000:.0f} | "
        f"{percentile(latencies, 0.99) * 1000:.0f} | {statuses} | {new / decisions:.0f} | {share:.1%} | "
        f"{per('slotread_engine_prefix_cache_hits')} / {per('slotread_engine_prefix_cache_misses')} | "
        f"{counters.get('slotread_engine_graph_captures', 0):.0f} / "
        f"{counters.get('slotread_engine_layer_graph_captures', 0):.0f} | {per('process_cpu_seconds_total', 1000)} | "
        f"{per('replica_cpu_seconds', 1000)} | {engine} | {per('slotread_engine_vision_runs')} |"
    )


HEADER = (
    "| topology | workload | c | decisions/s | p50 ms | p99 ms | statuses | new tokens/dec | bf16 peak | "
    "cache hits / misses per dec | graph captures: forwards / layer pieces | host CPU ms/dec | "
    "engine process / replica CPU ms/dec | engine busy / decisions per call | vision runs/dec |\n"
    "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"
)


def engine_pids(server: subprocess.Popen[bytes], replicas: list[subprocess.Popen[bytes]]) -> list[int]:
    """The processes running the engines: the gateway's replicas, else the server's engine process (if any)."""
    return [replica.pid for replica in replicas] or children(server.pid)


def profiled(
    args: argparse.Namespace, topology: str, server: subprocess.Popen[bytes], replicas: list[subprocess.Popen[bytes]]
) -> str:
    """The processes ``--profile`` samples, as the client's ``--profile`` takes them (NAME=PID,...): the
    server and its replicas or its engine process."""
    engines = engine_pids(server, replicas)
    named = [(topology, server.pid), *((f"engine-{index}", pid) for index, pid in enumerate(engines))]
    return ",".join(f"{name}={pid}" for name, pid in named) if args.profile else ""


def wrapper(args: argparse.Namespace, report: Path, recording: Path) -> list[str]:
    """``start``'s wrapper for a process running an engine under ``--torch-profile`` (its profiles go
    to ``report``) or ``--replay`` (its last calls to ``recording``)."""
    for path in (report, report.with_suffix(".arm"), recording, recording.with_suffix(".dump")):
        path.unlink(missing_ok=True)
    if args.torch_profile:
        return [str(Path(__file__).with_name("call_profile.py")), str(args.torch_profile), str(report)]
    if args.replay:
        return [str(Path(__file__).with_name("call_replay.py")), str(args.replay), str(recording)]
    return []


def appeared(path: Path, seconds: float = 60.0) -> bool:
    """Whether ``path`` exists within ``seconds`` (a file a server process writes when it is done)."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return path.exists()


def recorded(recordings: list[Path], row: str) -> list[Path]:
    """Each process's calls of the row just run (``call_replay.py``), renamed for the row: waits up to
    a minute for each to be written."""
    rows = []
    for recording in recordings:
        if not appeared(recording):
            print(f"{recording.name}: no calls recorded for {row}", file=sys.stderr)
            continue
        rows.append(recording.rename(recording.with_name(f"{row}-{recording.name}")))
    return rows


def torch_profiles(reports: list[Path], calls: int) -> str:
    """The sections the armed processes appended to ``reports`` for the row just run (waiting up to a
    minute for ``calls`` engine calls to finish them), as text; each file is then removed, so the next
    row's starts empty (the caller keeps the row's copy)."""
    texts = []
    for report in reports:
        if not appeared(report):
            texts.append(f"{report.name}: no profile ({calls} engine calls did not happen within a minute)")
            continue
        text = report.read_text()
        report.unlink()
        texts.append(f"{report.name}:\n{text}")
    return "\n".join(texts)


def serve_phase(args: argparse.Namespace, topology: str, out: Path, recordings: list[Path]) -> list[str]:
    """The rows of one topology; ``--replay`` appends each row's recorded calls to ``recordings``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes = []
    replicas: list[subprocess.Popen[bytes]] = []  # the gateway's engines
    common = ["--model", args.model]
    # ``--torch-profile`` and ``--replay``: one report and one recording per process running an engine
    reports: list[Path] = []
    records: list[Path] = []
    try:
        if topology == "gateway":
            upstreams = []
            for replica in range(args.replicas):
                engine_port = free_port()
                engine_log = out / f"engine-{replica}.log"
                # one GPU each where there are several
                env = {"CUDA_VISIBLE_DEVICES": str(replica)} if args.replicas > 1 and args.device == "cuda" else {}
                reports.append(out / f"engine-{replica}-torch.md")
                records.append(out / f"engine-{replica}-calls.pkl")
                engine = start(
                    ["engine", *common, "--device", args.device, "--dtype", args.dtype, "--port", str(engine_port)],
                    engine_log,
                    env,
                    wrapper(args, reports[-1], records[-1]),
                )
                processes.append(engine)
                replicas.append(engine)
                wait_ready(f"http://127.0.0.1:{engine_port}", engine, engine_log, "/healthz")
                upstreams += ["--upstream", f"http://127.0.0.1:{engine_port}"]
            command = ["serve", *common, *upstreams, "--port", str(port)]
        else:
            command = ["serve", *common, "--device", args.device, "--dtype", args.dtype, "--port", str(port)]
        log = out / f"{topology}.log"
        if not replicas:
            reports.append(out / f"{topology}-torch.md")
            records.append(out / f"{topology}-calls.pkl")
        server = start(command, log, wrapper=() if replicas else wrapper(args, reports[0], records[0]))
        armed = [report.with_suffix(".arm") for report in reports] if args.torch_profile else []
        dumps = [record.with_suffix(".dump") for record in records] if args.replay else []
        processes.append(server)
        started = time.monotonic()
        wait_ready(url, server, log)
        print(f"{topology}: ready in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        rows = []
        for workload in args.workloads:
            for concurrency in args.concurrency:
                if replicas and args.kill_replica_after is not None and len(replicas) > 1:
                    # the last replica dies mid-run (SIGKILL, as a crash), once: later rows run on the rest
                    victim = replicas.pop()
                    kill_at = args.warmup + args.kill_replica_after
                    threading.Timer(
                        kill_at, lambda v=victim: v.poll() is None and os.killpg(v.pid, signal.SIGKILL)
                    ).start()
                client = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "client",
                        "--url",
                        url,
                        "--workload",
                        workload,
                        "--concurrency",
                        str(concurrency),
                        "--seconds",
                        str(args.seconds),
                        "--warmup",
                        str(args.warmup),
                        "--replica-pids",
                        ",".join(str(pid) for pid in engine_pids(server, replicas)),
                        "--arm",
                        ",".join(str(trigger) for trigger in armed),
                        "--dump",
                        ",".join(str(trigger) for trigger in dumps),
                        "--profile",
                        profiled(args, topology, server, replicas),
                        "--profile-to",
                        str(out / f"{topology}-{workload}-c{concurrency}"),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(client.stdout.strip().splitlines()[-1])
                (out / f"{topology}-{workload}-c{concurrency}.json").write_text(json.dumps(result))
                rows.append(row(topology, workload, concurrency, result, args))
                for text in result.get("profiles", []):
                    print(text, file=sys.stderr, flush=True)
                if dumps:
                    recordings += recorded(records, f"{topology}-{workload}-c{concurrency}")
                if armed:
                    text = torch_profiles(reports, args.torch_profile)
                    (out / f"{topology}-{workload}-c{concurrency}-torch.md").write_text(text + "\n")
                    print(text, file=sys.stderr, flush=True)
                if args.kill_replica_after is not None and topology == "gateway":
                    print(
                        f"{topology} {workload} c={concurrency} decisions per second: {result['per_second']}",
                        file=sys.stderr,
                    )
                print(rows[-1], file=sys.stderr, flush=True)
        return rows
    finally:
        for process in reversed(processes):
            stop(process)


REPLAY_HEADER = (
    "\n| recorded calls of | calls timed | reads per call (mean, each in order) | ms per call in the server | "
    "ms per call alone | server / alone | graph captures |\n|---|---:|---:|---:|---:|---:|---:|"
)


def replay_phase(args: argparse.Namespace, recordings: list[Path]) -> list[str]:
    """``--replay``: each row's recorded engine calls read again in this process, alone
    (``call_replay.replay``)."""
    import torch
    from call_replay import replay

    from slotread import Decider

    engine = Decider(args.model, device=args.device, dtype=getattr(torch, args.dtype)).engine
    rows = []
    for recording in recordings:
        calls, reads, server, alone, captures = replay(engine, recording, args.device)
        name = recording.name.removesuffix("-calls.pkl")
        sizes = f"{statistics.mean(reads):.1f} ({', '.join(map(str, reads))})"
        rows.append(f"| {name} | {calls} | {sizes} | {server:.0f} | {alone:.0f} | {server / alone:.2f} | {captures} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def engine_phase(args: argparse.Namespace) -> list[str]:
    """``Engine.read`` alone on the reads the Decider renders for the same requests: each workload's
    decisions are answered once through a recording engine, the prefix cache is cleared, two batches
    warm it up (the shared instructions and schemas), then batches of C decisions' reads are timed."""
    import torch

    from slotread import Decider
    from slotread.engines.base import ReadRequest, SlotScores

    class Recording:
        def __init__(self, engine: Any) -> None:
            self.engine = engine
            self.calls: list[list[ReadRequest]] = []

        def __getattr__(self, name: str) -> Any:  # what the Decider asks of an engine besides reads
            return getattr(self.engine, name)

        def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
            self.calls.append(requests)
            result: list[SlotScores] = self.engine.read(requests)
            return result

        def think(self, requests: list[Any]) -> list[tuple[int, ...]]:
            # w1-think64: the thoughts are generated while recording; the timed reads follow them
            thoughts: list[tuple[int, ...]] = self.engine.think(requests)
            return thoughts

    decider = Decider(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    engine = decider.engine
    rows = []
    for workload in [w for w in args.workloads if w != "w2"]:
        for concurrency in args.concurrency:
            batches = 2 + args.engine_batches
            recorder = Recording(engine)
            decider.engine = recorder  # type: ignore[assignment]
            rng = random.Random(7)
            decisions = []
            for _ in range(batches * concurrency):
                recorder.calls = []
                decider.decide(make_request(workload, rng))
                decisions.append([request for call in recorder.calls for request in call])
            decider.engine = engine
            engine.prefix_cache.clear()
            times = []
            for batch in range(batches):
                merged = [r for d in decisions[batch * concurrency : (batch + 1) * concurrency] for r in d]
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.perf_counter()
                engine.read(merged)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if batch >= 2:
                    times.append(time.perf_counter() - started)
            median = statistics.median(times)
            rows.append(
                f"| engine alone | {workload} | {concurrency} | {concurrency / median:.1f} | {median * 1000:.0f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        parser = argparse.ArgumentParser()
        parser.add_argument("client")
        for flag in ("--url", "--workload"):
            parser.add_argument(flag, required=True)
        parser.add_argument("--concurrency", type=int, required=True)
        parser.add_argument("--seconds", type=float, required=True)
        parser.add_argument("--warmup", type=float, required=True)
        parser.add_argument("--replica-pids", default="", type=lambda s: [int(pid) for pid in s.split(",") if pid])
        parser.add_argument("--arm", default="", type=lambda s: [Path(path) for path in s.split(",") if path])
        parser.add_argument("--dump", default="", type=lambda s: [Path(path) for path in s.split(",") if path])
        parser.add_argument("--profile", default="", type=lambda s: dict(p.split("=", 1) for p in s.split(",") if p))
        parser.add_argument("--profile-to", type=Path)
        client_main(parser.parse_args())
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="what slotread serve --model takes (random:DIR on a GPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workloads", default="w1,w1-joint,w2", type=lambda s: s.split(","))
    parser.add_argument("--concurrency", default="1,8,32,64", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per row")
    parser.add_argument("--warmup", type=float, default=10.0, help="untimed seconds before each row")
    parser.add_argument("--topologies", default="serve", type=lambda s: s.split(","), help="serve,gateway")
    parser.add_argument("--replicas", type=int, default=1, help="slotread engine processes behind the gateway")
    parser.add_argument(
        "--kill-replica-after",
        type=float,
        default=None,
        help="gateway with 2+ replicas: kill the last replica this many seconds into the first row's timed phase",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy on the server (and replicas) in each timed phase (needs py-spy)",
    )
    parser.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="torch-profile this many engine calls of each process running an engine, from each timed phase's start",
    )
    parser.add_argument(
        "--replay",
        type=int,
        default=0,
        metavar="CALLS",
        help="record each row's last 2 x CALLS engine calls, then replay them alone after the servers stop",
    )
    parser.add_argument("--engine-only", action="store_true", help="then time Engine.read alone on the same reads")
    parser.add_argument("--engine-batches", type=int, default=5, help="timed batches per engine-only row")
    parser.add_argument("--active-params", type=float, default=3.8e9, help="active parameters per token")
    parser.add_argument("--peak-tflops", type=float, default=788.0, help="bf16 peak measured on the device")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "serve_load")
    args = parser.parse_args()
    if args.torch_profile and args.device.startswith("cuda"):
        parser.error(
            "--torch-profile runs on the CPU only for now: on the H200 it stalled the server (call_profile.py)"
        )
    if args.torch_profile and args.replay:
        parser.error("--torch-profile and --replay each wrap the engine's process: choose one")
    args.out.mkdir(parents=True, exist_ok=True)
    # the servers run in sessions of their own: a SIGTERM (timeout) must still reach the ``finally`` that stops them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[str] = []
    recordings: list[Path] = []
    for topology in args.topologies:
        rows += serve_phase(args, topology, args.out, recordings)
    print(HEADER)
    print("\n".join(rows))
    if recordings:
        print(REPLAY_HEADER)
        print("\n".join(replay_phase(args, recordings)))
    if args.engine_only:
        engine_rows = engine_phase(args)
        print("\n| diagnostic | workload | c | decisions/s | ms per batch |\n|---|---|---:|---:|---:|")
        print("\n".join(engine_rows))


if __name__ == "__main__":
    main()
