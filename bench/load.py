"""Load a running server: N concurrent clients for T seconds; throughput, latency percentiles, status codes.

    slotread serve &                      # the default model, http://127.0.0.1:8000
    python bench/load.py --clients 32 --seconds 60

Each client posts System One decisions back to back (the README's support-ticket questions about a
rotating set of messages). A 429/529 is counted and, like the official SDK, the client waits the
``retry-after-ms`` it was given before its next request. The table reports latency over successful
requests only, the status codes seen, and whether every non-200 carried ``retry-after``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from dataclasses import dataclass, field

import httpx
from helpers import SUPPORT_MESSAGES, TICKET_QUESTIONS, percentile


@dataclass
class Tally:
    """What the clients saw."""

    latencies: list[float] = field(default_factory=list)
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    refusals_without_retry_after: int = 0


async def client_loop(client: httpx.AsyncClient, index: int, stop_at: float, tally: Tally) -> None:
    """One client: post decisions until ``stop_at``."""
    sent = 0
    while time.monotonic() < stop_at:
        body = {"state": SUPPORT_MESSAGES[(index + sent) % len(SUPPORT_MESSAGES)], "questions": TICKET_QUESTIONS}
        sent += 1
        started = time.monotonic()
        try:
            response = await client.post("/v1/systemone", json=body)
        except httpx.HTTPError as exc:
            tally.statuses[type(exc).__name__] += 1
            continue
        tally.statuses[str(response.status_code)] += 1
        if response.status_code == 200:
            tally.latencies.append(time.monotonic() - started)
        elif response.status_code in (429, 529, 503):
            wait_ms = response.headers.get("retry-after-ms")
            if wait_ms is None and response.headers.get("retry-after") is None:
                tally.refusals_without_retry_after += 1
            await asyncio.sleep(min(float(wait_ms or 1000) / 1000, max(0.0, stop_at - time.monotonic())))
        else:
            tally.refusals_without_retry_after += 1


async def run(url: str, clients: int, seconds: float, api_key: str | None, timeout: float) -> Tally:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        ready = await client.get("/readyz")
        if ready.status_code != 200:
            raise SystemExit(f"{url} is not ready: {ready.status_code} {ready.text}")
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(client_loop(client, i, stop_at, tally) for i in range(clients)))
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to hold the load")
    parser.add_argument("--api-key", default=None, help="API key, when the server has auth on")
    parser.add_argument("--timeout", type=float, default=10.0, help="client timeout in seconds (the SDK's default)")
    args = parser.parse_args()
    started = time.monotonic()
    tally = asyncio.run(run(args.url, args.clients, args.seconds, args.api_key, args.timeout))
    elapsed = time.monotonic() - started
    done = len(tally.latencies)
    print(f"{args.clients} clients for {args.seconds:g} s against {args.url}\n")
    print("| decisions/s | p50 ms | p95 ms | p99 ms | max ms |")
    print("|---:|---:|---:|---:|---:|")
    latencies = [1000 * s for s in tally.latencies]
    cells = [percentile(latencies, q) for q in (0.5, 0.95, 0.99)]
    worst = max(latencies, default=float("nan"))
    print(f"| {done / elapsed:.2f} | {cells[0]:.0f} | {cells[1]:.0f} | {cells[2]:.0f} | {worst:.0f} |\n")
    print("| status | count |")
    print("|---|---:|")
    for status, count in sorted(tally.statuses.items()):
        print(f"| {status} | {count} |")
    fivexx = sum(count for status, count in tally.statuses.items() if status.startswith("5") and status != "529")
    print(f"\n5xx other than 529: {fivexx}; non-200 without retry-after: {tally.refusals_without_retry_after}")


if __name__ == "__main__":
    main()
