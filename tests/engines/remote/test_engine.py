"""RemoteEngine on two real ``slotread engine`` servers of the tiny DiffusionGemma (float32, loopback).

Its reads must score what the in-process engine scores, a read of more than 128 labels included,
and start-up must refuse replicas that serve another model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.remote import engine as remote_engine_module
from slotread.engines.remote.engine import RemoteEngine
from slotread.engines.remote.wire import completion_bodies
from slotread.errors import ModelLoadError
from slotread.models.load import LoadedModel
from slotread.models.tiny import GEMMA4_VOCAB_SIZE
from slotread.serve.engine_app import ServedEngine, create_engine_app
from tests.engines.remote.replicas import Replica, free_port
from tests.serve.live import live_server

VOCAB = GEMMA4_VOCAB_SIZE


def remote_engine(urls: list[str], model: str, timeout_s: float = 10.0) -> RemoteEngine:
    return RemoteEngine(
        urls, model=model, family="diffusion", vocab_size=VOCAB, timeout_s=timeout_s, health_interval_s=0.5
    )


@pytest.fixture(scope="module")
def remote(diffusion_replicas: list[Replica], tiny_diffusion_dir: Path) -> Iterator[RemoteEngine]:
    engine = remote_engine([replica.url for replica in diffusion_replicas], str(tiny_diffusion_dir))
    yield engine
    engine.close()


def random_requests() -> list[ReadRequest]:
    generator = torch.Generator().manual_seed(2)

    def ids(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, VOCAB, (length,), generator=generator).tolist())

    many = tuple((torch.randperm(VOCAB - 3, generator=generator)[:255] + 3).tolist())  # distinct
    return [
        ReadRequest(prompt=(ids(5), ids(30)), canvas=ids(16), slots=(Slot(3, ids(2)),), seed=7),
        # 255 labels: more than vLLM's 128 per request
        ReadRequest(prompt=(ids(12),), canvas=ids(16), slots=(Slot(2, many),), seed=8),
        # a joint canvas of two slots, read as given
        ReadRequest(prompt=(ids(20),), canvas=ids(32), slots=(Slot(4, ids(3)), Slot(9, ids(5))), seed=None),
    ]


def probabilities(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    exp = np.exp(values - values.max())
    return exp / exp.sum()


def assert_same_scores(remote: SlotScores, local: SlotScores, tolerance: float = 1e-5) -> None:
    for slot, (theirs, ours) in enumerate(zip(remote.logits, local.logits, strict=True)):
        difference = np.abs(probabilities(theirs) - probabilities(ours)).max()
        assert difference <= tolerance, f"slot {slot}: label probabilities differ by {difference:.2e}"
    assert np.allclose(remote.label_mass, local.label_mass, rtol=10 * tolerance, atol=0)
    assert remote.argmax_id == local.argmax_id
    assert remote.argmax_is_label == local.argmax_is_label


def test_reads_score_what_the_in_process_engine_scores(remote: RemoteEngine, tiny_diffusion: LoadedModel) -> None:
    local = DiffusionGemmaEngine(tiny_diffusion.model)
    requests = random_requests()
    assert len(completion_bodies(requests[1], "diffusion", remote.model, VOCAB)) == 2  # split
    for theirs, ours in zip(remote.read(requests), local.read(requests), strict=True):
        assert_same_scores(theirs, ours)
    assert remote.max_tokens == local.max_tokens  # the replicas' max_model_len


def requests_sent(engine: RemoteEngine) -> int:
    return sum(stats.outcomes.get("ok", 0) for stats in engine.pool.stats())


def test_a_calls_reads_reach_a_slotread_replica_in_one_request(
    remote: RemoteEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert remote.slotread  # both replicas list themselves owned_by slotread
    requests = random_requests()
    before = requests_sent(remote)
    whole = remote.read(requests)  # four bodies
    assert requests_sent(remote) == before + 1
    # a call of more than BATCH bodies is spread over several requests, each answered in its place
    monkeypatch.setattr(remote_engine_module, "BATCH", 3)
    before = requests_sent(remote)
    for theirs, ours in zip(remote.read(requests), whole, strict=True):
        assert_same_scores(theirs, ours)
    assert requests_sent(remote) == before + 2


def as_vllm(app: FastAPI, bodies: list[Any]) -> FastAPI:
    """The engine app listing its model as vLLM does (``owned_by: "vllm"``), keeping every completions body."""

    @app.middleware("http")
    async def listed_as_vllm(request: Request, call_next: Any) -> Response:
        if request.url.path == "/v1/completions":
            bodies.append(json.loads(await request.body()))
        response = await call_next(request)
        if request.url.path != "/v1/models":
            return response
        listing = json.loads(b"".join([chunk async for chunk in response.body_iterator]))
        for entry in listing["data"]:
            entry["owned_by"] = "vllm"
        return JSONResponse(listing)

    return app


def test_a_vllm_replica_gets_one_plain_body_per_read(tiny_diffusion: LoadedModel) -> None:
    served = ServedEngine.from_loaded(tiny_diffusion)
    bodies: list[Any] = []
    requests = random_requests()
    with live_server(as_vllm(create_engine_app(served), bodies), ready=False) as live:
        engine = remote_engine([live.url], served.name)
        try:
            assert not engine.slotread
            scores = engine.read(requests)
            # once the gateway batches, a replica that is not a slotread engine may not join
            assert remote_refusal(engine, "vllm") is None
        finally:
            engine.close()
    assert len(bodies) == 4  # one per 128 labels of each read
    assert all(type(body["prompt"][0]) is int and not any(key.startswith("x_") for key in body) for body in bodies)
    for theirs, ours in zip(scores, DiffusionGemmaEngine(tiny_diffusion.model).read(requests), strict=True):
        assert_same_scores(theirs, ours)


def remote_refusal(engine: RemoteEngine, owner: str) -> str | None:
    listing = {"data": [{"id": engine.model, "max_model_len": engine.max_tokens, "owned_by": owner}]}
    return engine._refusal(listing)


def test_a_batching_gateway_admits_slotread_replicas_only(remote: RemoteEngine) -> None:
    assert remote_refusal(remote, "slotread") is None
    assert remote_refusal(remote, "vllm") == (
        "it is not a slotread engine, and the gateway sends its reads in slotread's batches"
    )


def test_a_replica_serving_another_model_stops_start_up(diffusion_replicas: list[Replica]) -> None:
    with pytest.raises(ModelLoadError, match=r"upstream http://127\.0\.0\.1:\d+ serves '.*', not 'another-model'"):
        remote_engine([diffusion_replicas[0].url], "another-model")


def test_start_up_needs_a_replica_that_answers(tiny_diffusion_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no upstream answered GET /v1/models \(http://127\.0\.0\.1:\d+: Connect"):
        remote_engine([f"http://127.0.0.1:{free_port()}"], str(tiny_diffusion_dir))


def test_a_replica_down_at_start_is_left_out(diffusion_replicas: list[Replica], tiny_diffusion_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine = remote_engine([dead, diffusion_replicas[0].url], str(tiny_diffusion_dir))
    try:
        assert [stats.up for stats in engine.pool.stats()] == [False, True]
        assert len(engine.read(random_requests()[:1])) == 1
    finally:
        engine.close()


def test_multi_step_reads_score_what_the_in_process_engine_scores(
    diffusion_replicas: list[Replica], tiny_diffusion_dir: Path, tiny_diffusion: LoadedModel
) -> None:
    """A 4-step read goes out as diffusion_max_steps 4 with every position but the slots pinned, and the
    engine server denoises it as the in-process engine does (its sampler seeded by the same noised canvas)."""
    # four full-vocabulary steps at every canvas position take a while on a busy CPU
    remote = remote_engine([replica.url for replica in diffusion_replicas], str(tiny_diffusion_dir), timeout_s=120.0)
    requests = [replace(request, steps=4) for request in random_requests()]
    (body, *_) = completion_bodies(requests[2], "diffusion", remote.model, VOCAB)
    xargs = body["vllm_xargs"]
    assert xargs["diffusion_max_steps"] == 4
    assert xargs["diffusion_pinned"] == [p for p in range(32) if p not in (4, 9)]
    local = DiffusionGemmaEngine(tiny_diffusion.model)
    # the server reads every position at the last step, so its batch shapes differ: 4 steps' rounding
    try:
        for theirs, ours in zip(remote.read(requests), local.read(requests), strict=True):
            assert_same_scores(theirs, ours, tolerance=1e-4)
    finally:
        remote.close()
    one_step = local.read(random_requests())
    assert not np.allclose(one_step[0].logits[0], local.read(requests[:1])[0].logits[0], atol=1e-3)
