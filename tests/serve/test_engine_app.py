"""The engine server: vLLM-shaped reads on the tiny DiffusionGemma and SmolLM2-135M (float32).

A read sent through the wire (``completion_bodies`` -> HTTP -> ``slot_scores``) must answer what the
in-process engine answers: label log-probabilities within 1e-5.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from slotread.core.questions import Option, Question
from slotread.core.reads import question_text
from slotread.engines.base import ReadRequest, SlotScores
from slotread.engines.remote.wire import batch_body, batch_responses, completion_bodies, slot_scores
from slotread.models.load import LoadedModel
from slotread.prompt.render import Renderer
from slotread.serve.batcher import BatchingEngine
from slotread.serve.engine_app import ServedEngine, create_engine_app
from tests.serve.live import HeldEngine, live_server

STATES = ["My card still hasn't arrived after two weeks.", "Thanks, all sorted now!", "Someone stole my wallet."]
URGENT = Question("urgent", "noul", "Is this urgent?", (Option("yes"), Option("no")))
MOOD = Question("mood", "score", "How upset is the customer?", tuple(Option(level) for level in "01234"))
INTENT = Question("intent", "choice", "Which intent?", tuple(Option(f"intent {i}") for i in range(200)))


def render(loaded: LoadedModel, questions: list[Question], state: str) -> ReadRequest:
    """A real read: one question as its own branch, or several in one DiffusionGemma canvas; noise seed 3."""
    renderer = Renderer(loaded.tokenizer, loaded.family)
    texts = [question_text(question, renderer) for question in questions]
    if len(texts) == 1:
        return renderer.render_branch(texts[0], state).with_seed(3)
    return renderer.render_joint(tuple(texts), state).with_seed(3)


def read_remote(client: httpx.Client | TestClient, request: ReadRequest, served: ServedEngine) -> SlotScores:
    bodies = completion_bodies(request, served.engine.family, served.name, served.vocab_size)
    responses = [client.post("/v1/completions", json=body) for body in bodies]
    for response in responses:
        assert response.status_code == 200, response.text
    return slot_scores(request, bodies, [response.json() for response in responses])


def assert_same_read(remote: SlotScores, local: SlotScores, tolerance: float = 1e-5) -> None:
    """The remote label logprobs, label probabilities, mass and argmax equal the in-process read's."""
    worst = 0.0
    for i, logits in enumerate(local.logits):
        logprobs = logits.astype(np.float64) - local.log_normalizer[i]
        got = remote.logits[i].astype(np.float64)
        worst = max(worst, float(np.abs(got - logprobs).max()))
        expected = np.exp(logprobs - logprobs.max()) / np.exp(logprobs - logprobs.max()).sum()
        np.testing.assert_allclose(np.exp(got - got.max()) / np.exp(got - got.max()).sum(), expected, atol=tolerance)
    print(f"max |remote - in-process| label logprob {worst:.3g}")
    assert worst <= tolerance
    np.testing.assert_allclose(remote.label_mass, local.label_mass, rtol=tolerance)
    assert remote.argmax_id == local.argmax_id and remote.argmax_is_label == local.argmax_is_label
    local_top = [logit - normalizer for logit, normalizer in zip(local.argmax_logit, local.log_normalizer, strict=True)]
    np.testing.assert_allclose(remote.argmax_logit, local_top, atol=tolerance)


@pytest.fixture(scope="module")
def diffusion(tiny_diffusion: LoadedModel) -> Iterator[tuple[TestClient, ServedEngine]]:
    served = ServedEngine.from_loaded(tiny_diffusion)
    with TestClient(create_engine_app(served)) as client:
        yield client, served


@pytest.fixture(scope="module")
def causal(smollm2: LoadedModel) -> Iterator[tuple[TestClient, ServedEngine]]:
    served = ServedEngine.from_loaded(smollm2)
    with TestClient(create_engine_app(served)) as client:
        yield client, served


def test_a_diffusion_read_equals_the_in_process_read(
    diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel
) -> None:
    client, served = diffusion
    local = ServedEngine.from_loaded(tiny_diffusion).engine
    for state in STATES[:2]:
        request = render(tiny_diffusion, [URGENT], state)
        assert_same_read(read_remote(client, request, served), local.read([request])[0])


def test_a_joint_read_of_207_labels_is_split_and_equals_the_in_process_read(
    diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel
) -> None:
    client, served = diffusion
    request = render(tiny_diffusion, [URGENT, INTENT, MOOD], STATES[0])
    bodies = completion_bodies(request, "diffusion", served.name, served.vocab_size)
    assert [len(body["logprob_token_ids"]) for body in bodies] == [128, 79]  # 2 + 200 + 5 labels
    local = ServedEngine.from_loaded(tiny_diffusion).engine.read([request])[0]
    assert_same_read(read_remote(client, request, served), local)


def test_a_causal_read_equals_the_in_process_read(
    causal: tuple[TestClient, ServedEngine], smollm2: LoadedModel
) -> None:
    client, served = causal
    local = ServedEngine.from_loaded(smollm2).engine
    for question in (URGENT, MOOD):
        request = render(smollm2, [question], STATES[2])
        # SmolLM2's logits near 20 round per batch shape by up to 1.2e-5 (engines/base.py)
        assert_same_read(read_remote(client, request, served), local.read([request])[0], tolerance=2e-5)


def test_the_response_has_vllms_shape(diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel) -> None:
    client, served = diffusion
    request = render(tiny_diffusion, [URGENT], STATES[1])
    (body,) = completion_bodies(request, "diffusion", served.name, served.vocab_size)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    completion = json.loads(response.text, parse_constant=lambda name: pytest.fail(f"{name} in the body"))
    canvas = len(request.canvas)
    assert completion["id"].startswith("cmpl-") and completion["object"] == "text_completion"
    assert completion["model"] == served.name and type(completion["created"]) is int
    assert completion["usage"] == {
        "prompt_tokens": len(request.prompt_ids),
        "completion_tokens": canvas,
        "total_tokens": len(request.prompt_ids) + canvas,
    }
    (choice,) = completion["choices"]
    logprobs = choice["logprobs"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "", "length")
    assert [len(logprobs[name]) for name in ("tokens", "token_logprobs", "text_offset", "top_logprobs")] == [canvas] * 4
    labels = {f"token_id:{i}" for i in body["logprob_token_ids"]}
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert set(top) == labels | {token} and top[token] == logprob
        assert logprob == max(top.values()) <= 0.0


def wait_queued(batcher: BatchingEngine, reads: int) -> None:
    """Wait until ``reads`` reads queue for the batcher's next call (30 s at most)."""
    deadline = time.monotonic() + 30
    while batcher.pending < reads:
        assert time.monotonic() < deadline, "the reads never queued"
        time.sleep(0.005)


def test_concurrent_reads_go_to_the_engine_in_one_batch(tiny_diffusion: LoadedModel) -> None:
    served = ServedEngine.from_loaded(tiny_diffusion)
    requests = [render(tiny_diffusion, [question], state) for question in (URGENT, MOOD) for state in STATES[:2]]
    requests.append(render(tiny_diffusion, [URGENT], STATES[2]))
    alone = [served.engine.read([request])[0] for request in requests]
    held = HeldEngine(served.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads))
    app = create_engine_app(ServedEngine(served.name, batcher, served.vocab_size))
    with live_server(app, ready=False) as live, live.client() as client, ThreadPoolExecutor(5) as pool:
        first = pool.submit(read_remote, client, requests[0], served)
        assert held.entered.wait(30)
        rest = [pool.submit(read_remote, client, request, served) for request in requests[1:]]
        wait_queued(batcher, 4)
        held.release.set()
        results = [first.result(60), *(future.result(60) for future in rest)]
    assert sizes == [1, 4]
    for remote, local in zip(results, alone, strict=True):
        assert_same_read(remote, local)


def test_a_read_whose_client_hung_up_before_its_call_is_not_read(tiny_diffusion: LoadedModel) -> None:
    """A gateway gives up on a read at its decision's deadline; a replica that has fallen behind must
    not then spend its engine on it."""
    served = ServedEngine.from_loaded(tiny_diffusion)
    requests = [render(tiny_diffusion, [URGENT], state) for state in STATES]
    held = HeldEngine(served.engine)
    sizes: list[int] = []
    batcher = BatchingEngine(held, observe=lambda reads, seconds: sizes.append(reads))
    app = create_engine_app(ServedEngine(served.name, batcher, served.vocab_size))
    with live_server(app, ready=False) as live, live.client() as client, ThreadPoolExecutor(3) as pool:
        first = pool.submit(read_remote, client, requests[0], served)
        assert held.entered.wait(30)
        with live.client(timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
            read_remote(impatient, requests[1], served)  # hangs up while the engine is busy
        kept = pool.submit(read_remote, client, requests[2], served)
        wait_queued(batcher, 2)
        held.release.set()
        first.result(60), kept.result(60)
    assert sizes == [1, 1]  # the hung-up read was dropped from the second call


def test_a_batch_body_is_read_in_one_engine_call(tiny_diffusion: LoadedModel) -> None:
    """A gateway's reads of one stage in one body (two of them split over 207 labels) reach the engine as
    one call, and each answers what it answers alone in process."""
    served = ServedEngine.from_loaded(tiny_diffusion)
    requests = [
        render(tiny_diffusion, [URGENT], STATES[0]),
        render(tiny_diffusion, [URGENT, INTENT, MOOD], STATES[1]),
        render(tiny_diffusion, [MOOD], STATES[2]),
    ]
    bodies = [completion_bodies(request, "diffusion", served.name, served.vocab_size, True) for request in requests]
    flat = [body for request_bodies in bodies for body in request_bodies]
    assert len(flat) == 4
    sizes: list[int] = []
    app = create_engine_app(
        ServedEngine(
            served.name, BatchingEngine(served.engine, lambda reads, seconds: sizes.append(reads)), served.vocab_size
        )
    )
    with TestClient(app) as client:
        response = client.post("/v1/completions", json=batch_body(flat))
    assert response.status_code == 200, response.text
    assert sizes == [4]
    answers = batch_responses(response.json(), len(flat))
    local = ServedEngine.from_loaded(tiny_diffusion).engine
    start = 0
    for request, request_bodies in zip(requests, bodies, strict=True):
        remote = slot_scores(request, request_bodies, answers[start : start + len(request_bodies)])
        assert_same_read(remote, local.read([request])[0])
        start += len(request_bodies)
    assert response.json()["usage"]["prompt_tokens"] == sum(len(body["prompt"]) for body in flat)


def test_a_bad_read_in_a_batch_is_a_400_naming_it(
    diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel
) -> None:
    client, served = diffusion
    body = diffusion_body(served, tiny_diffusion)
    batch = batch_body([body, dict(body, logprob_token_ids=[VOCAB])])
    response = client.post("/v1/completions", json=batch)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "x_reads[1].logprob_token_ids"


# -- errors ------------------------------------------------------------------------------------------


def diffusion_body(served: ServedEngine, tiny_diffusion: LoadedModel) -> dict[str, Any]:
    (body,) = completion_bodies(
        render(tiny_diffusion, [URGENT], STATES[0]), "diffusion", served.name, served.vocab_size
    )
    return body


VOCAB = 262_144


@pytest.mark.parametrize(
    ("edit", "param"),
    [
        (lambda b: b["vllm_xargs"]["diffusion_seed_canvas"].pop(), "vllm_xargs.diffusion_seed_canvas"),
        (lambda b: b["vllm_xargs"]["diffusion_seed_canvas"].__setitem__(0, VOCAB), "vllm_xargs.diffusion_seed_canvas"),
        (lambda b: b["prompt"].append(VOCAB + 5), "prompt"),
        (lambda b: b["logprob_token_ids"].append(-1), "logprob_token_ids"),
        (lambda b: b.__setitem__("logprob_token_ids", list(range(129))), "logprob_token_ids"),
        (
            lambda b: (b["vllm_xargs"].pop("diffusion_seed_canvas"), b["vllm_xargs"].update(diffusion_pinned=[0])),
            "vllm_xargs.diffusion_pinned",
        ),
        (lambda b: b["vllm_xargs"].update(diffusion_pinned=[999]), "vllm_xargs.diffusion_pinned"),
        (lambda b: b.pop("vllm_xargs"), "vllm_xargs"),
        (lambda b: b["vllm_xargs"].update(diffusion_max_steps=9), "vllm_xargs.diffusion_max_steps"),
        (lambda b: b["vllm_xargs"].update(diffusion_read_only=False), "vllm_xargs.diffusion_read_only"),
        (lambda b: b.__setitem__("max_tokens", 3), "max_tokens"),
        (lambda b: b.__setitem__("logprobs", 20), "logprobs"),
        (lambda b: b.__setitem__("prompt", list(range(4_096))), "prompt"),
    ],
)
def test_a_bad_diffusion_body_is_a_400_in_vllms_shape(
    diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel, edit: Any, param: str
) -> None:
    client, served = diffusion
    body = diffusion_body(served, tiny_diffusion)
    edit(body)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        (
            {"vllm_xargs": {"diffusion_seed_canvas": [1, 2], "diffusion_canvas_length": 2}},
            "vllm_xargs.diffusion_seed_canvas",
        ),
        ({"max_tokens": 4}, "max_tokens"),
        ({"prompt": [1, 2, 49_152]}, "prompt"),
        ({"prompt": list(range(8_192))}, "prompt"),  # SmolLM2 has 8,192 positions: one more for the read
    ],
)
def test_a_bad_causal_body_is_a_400(
    causal: tuple[TestClient, ServedEngine], changes: dict[str, Any], param: str
) -> None:
    client, served = causal
    body = {"model": served.name, "prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 1, "logprob_token_ids": [7]}
    assert client.post("/v1/completions", json=body).status_code == 200
    response = client.post("/v1/completions", json={**body, **changes})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b'{"model": "x", "prompt": [1, ', {}, 400),  # malformed JSON
        (b"\xff\xfe", {}, 400),  # not UTF-8
        (b"[1, 2]", {}, 400),  # not an object
        (b'{"prompt": [1]}', {"content-encoding": "gzip"}, 400),  # not gzip
        (b"{}", {"content-encoding": "br"}, 415),
        (b"{" + b" " * (9 * 2**20) + b"}", {}, 413),
    ],
)
def test_bodies_that_are_not_json_objects_are_refused_in_vllms_shape(
    diffusion: tuple[TestClient, ServedEngine], content: bytes, headers: dict[str, str], status: int
) -> None:
    client, _ = diffusion
    response = client.post("/v1/completions", content=content, headers={"content-type": "application/json", **headers})
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == status


def test_another_models_name_and_unknown_routes_are_404(
    diffusion: tuple[TestClient, ServedEngine], tiny_diffusion: LoadedModel
) -> None:
    client, served = diffusion
    body = diffusion_body(served, tiny_diffusion)
    response = client.post("/v1/completions", json={**body, "model": "gpt-9"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "NotFoundError" and "gpt-9" in error["message"]
    assert client.post("/v1/chat/completions", json=body).json()["error"]["code"] == 404
    assert client.get("/v1/completions").json()["error"] == {
        "message": "Method Not Allowed",
        "type": "MethodNotAllowedError",
        "param": None,
        "code": 405,
    }
    # Without a model name the served one is read, as vLLM does.
    assert client.post("/v1/completions", json={k: v for k, v in body.items() if k != "model"}).status_code == 200


def test_models_and_health(diffusion: tuple[TestClient, ServedEngine]) -> None:
    client, served = diffusion
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    (model,) = listing["data"]
    assert model == {
        "id": served.name,
        "object": "model",
        "created": model["created"],
        "owned_by": "slotread",
        "max_model_len": 4096,
    }
    assert type(model["created"]) is int
    for path in ("/healthz", "/health"):
        assert client.get(path).json() == {"status": "ok"}


# -- the command ---------------------------------------------------------------------------------------


def test_the_engine_command_serves_reads_on_a_free_port(
    tiny_diffusion_dir: Path, tiny_diffusion: LoadedModel, tmp_path: Path
) -> None:
    log = tmp_path / "engine.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "slotread.cli", "engine", "--model", str(tiny_diffusion_dir), "--port", "0"]
    with log.open("w") as stderr:
        process = subprocess.Popen([*command, "--dtype", "float32"], stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 120
        while "ready on http://" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the engine did not get ready"
            time.sleep(0.1)
        url = log.read_text().split("ready on ")[1].split()[0]
        served = ServedEngine.from_loaded(tiny_diffusion)  # named by its directory, as the command names it
        request = render(tiny_diffusion, [URGENT, MOOD], STATES[0])
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/v1/models").json()["data"][0]["id"] == str(tiny_diffusion_dir)
            remote = read_remote(client, request, served)
        assert_same_read(remote, served.engine.read([request])[0])
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C (SIGTERM: tests/test_cli.py)
        # uvicorn shuts down gracefully; a clean shutdown exits 0, with no KeyboardInterrupt traceback
        assert process.wait(60) == 0, log.read_text()
        assert "Traceback" not in log.read_text()
