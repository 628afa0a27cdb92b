"""Same request, same answer, through the front door: alone, in a burst of concurrent others, first
after a (re)start and with a warm cache, and through ``Decider.decide`` (what ``slotread decide``
runs), on SmolLM2-135M in bfloat16 (the default dtype)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from slotread.decider import Decider
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.eval.datasets import load_dataset, subset
from slotread.eval.runner import build_request
from slotread.models.load import LoadedModel, load_model
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.live import Live, live_server

EXAMPLE = Path(__file__).parents[2] / "examples" / "support.json"
#: concurrent decisions in a burst; their reads reach the engine merged into few batches
BURST = 32


@pytest.fixture(scope="module")
def smollm2_bf16(cache_dir: Path) -> LoadedModel:
    return load_model("smollm2-135m-instruct", cache_dir=cache_dir, dtype=torch.bfloat16)


def dataset_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` SST-5 (a 5-level score) and ``count`` BANKING77 (a 77-option choice) requests, interleaved."""
    sets = [load_dataset(name) for name in ("sst5", "banking77")]
    picked = [[build_request(data.task, item, {}) for item in subset(data, count, seed).items] for data in sets]
    return [request for pair in zip(*picked, strict=True) for request in pair]


def numbers(value: Any, path: str = "") -> dict[str, float]:
    """Every number in an answer, keyed by its path (probabilities, confidences, entropies, masses)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in numbers(item, f"{path}/{key}").items()}
    if isinstance(value, bool) or not isinstance(value, int | float):
        return {}
    return {path: float(value)}


def worst_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The largest difference between two runs' answers; the answers' other fields must be equal."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        nx, ny = numbers(x["answers"]), numbers(y["answers"])
        assert nx.keys() == ny.keys()
        assert [a.get("choice") for a in x["answers"].values()] == [a.get("choice") for a in y["answers"].values()]
        worst = max(worst, *(abs(nx[key] - ny[key]) for key in nx))
    return worst


def counter(live: Live, name: str) -> float:
    with live.client() as client:
        match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def alone(live: Live, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with live.client() as client:
        return [client.post("/v1/systemone", json=request).raise_for_status().json() for request in requests]


def in_a_burst(live: Live, requests: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``requests`` answered inside one burst of ``BURST`` concurrent decisions, spread among ``others``."""
    step = BURST // len(requests)
    burst = list(others[: BURST - len(requests)])
    for k, request in enumerate(requests):
        burst.insert(k * step, request)
    reads, batches = counter(live, "slotread_reads_total"), counter(live, "slotread_engine_batches_total")
    # a burst on a slow CPU takes minutes (SmolLM2 in bfloat16 one row per forward: over 60 s on an AMD EPYC)
    with live.client(timeout=900) as client, ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda r: client.post("/v1/systemone", json=r).raise_for_status().json(), burst))
    merged = (counter(live, "slotread_reads_total") - reads) / (
        counter(live, "slotread_engine_batches_total") - batches
    )
    assert merged > 2  # reads of concurrent decisions did share engine batches
    return [answers[k * step] for k in range(len(requests))]


@pytest.mark.slow
def test_the_same_request_gets_the_same_answer_in_any_batch_and_cache_state(smollm2_bf16: LoadedModel) -> None:
    requests = [json.loads(EXAMPLE.read_text()), *dataset_requests(3, seed=0)]
    others = dataset_requests(BURST // 2, seed=1)
    # several decisions at once, so a burst's reads are merged into shared engine batches
    settings = Settings(max_concurrency=BURST, queue_size=BURST, request_deadline_s=600)

    with live_server(create_app(settings, Decider(smollm2_bf16))) as live:
        first = alone(live, requests)  # right after the start: the warm-up's cache only
        burst = in_a_burst(live, requests, others)
        warm = alone(live, requests)
    with live_server(create_app(settings, Decider(smollm2_bf16))) as live:  # a restart
        burst_first = in_a_burst(live, requests, others)
    decided = [Decider(smollm2_bf16).decide(request) for request in requests]  # no warm-up: a cold cache

    for other in (burst, warm, burst_first, decided):
        assert worst_difference(first, other) <= 1e-6


def test_answers_say_whether_they_are_deterministic(smollm2_bf16: LoadedModel, tiny_diffusion: LoadedModel) -> None:
    body = {"state": "My card has not arrived.", "questions": {"urgent": {"type": "noul"}}}
    # causal: one row per forward (the default) is deterministic; --deterministic keeps it so over --max-batch
    assert Decider(smollm2_bf16).decide(body)["x_deterministic"] is True
    assert Decider(smollm2_bf16, max_batch=8).decide(body)["x_deterministic"] is False
    batched = Decider(smollm2_bf16, max_batch=8, deterministic=True)
    assert batched.decide(body)["x_deterministic"] is True
    # DiffusionGemma batches unless asked; on the CPU its deterministic mode reads one canvas at a time
    assert Decider(tiny_diffusion).decide(body)["x_deterministic"] is False
    strict = Decider(tiny_diffusion, deterministic=True)
    assert strict.decide(body)["x_deterministic"] is True
    assert isinstance(strict.engine, DiffusionGemmaEngine) and strict.engine.mode == "one at a time"
