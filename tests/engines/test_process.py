"""The engine in a process of its own (``--engine-process``), on the tiny DiffusionGemma in float32:
the server answers what the in-process engine answers, a bad read fails alone, a failed load names the
model, and a killed engine process turns the server's answers, ``/readyz`` and ``/healthz`` into 503s."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from slotread.decider import Decider
from slotread.engines.base import ReadRequest, Slot
from slotread.engines.process import EngineProcessExited
from slotread.errors import ModelLoadError, PromptTooLong
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.live import live_server


def png(colour: tuple[int, int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 48), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


REQUESTS: list[dict[str, Any]] = [
    {
        "state": "My card was charged twice for one coffee.",
        "instructions": "You sort a bank's support messages.",
        "questions": {
            "urgent": {"type": "noul", "instructions": "Is money at stake?"},
            "topic": {"type": "choice", "criteria": {"card": "card payments", "fee": "fees", "other": "other"}},
            "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    },
    # a thought first (``Engine.think`` in the engine's process)
    {"state": "My card was charged twice.", "x_think": 8, "questions": {"urgent": {"type": "noul"}}},
    # an image: prepared here, read by the vision tower in the engine's process
    {"state": "What colour is it?", "images": [png((200, 30, 30))], "questions": {"red": {"type": "noul"}}},
]


@pytest.fixture(scope="module")
def decider(tiny_diffusion_dir: Path) -> Iterator[Decider]:
    decider = Decider(str(tiny_diffusion_dir), dtype=torch.float32, engine_process=True)
    yield decider
    decider.close()


def assert_close(theirs: Any, ours: Any, path: str = "answers") -> None:
    """Equal answers: the same fields and words, numbers within float32 rounding."""
    if isinstance(ours, dict):
        assert theirs.keys() == ours.keys(), path
        for key in ours:
            assert_close(theirs[key], ours[key], f"{path}/{key}")
    elif isinstance(ours, list):
        assert len(theirs) == len(ours), path
        for index, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            assert_close(a, b, f"{path}/{index}")
    elif isinstance(ours, float):
        assert abs(theirs - ours) <= 1e-6, (path, theirs, ours)
    else:
        assert theirs == ours, path


def test_answers_equal_the_in_process_engines(decider: Decider, tiny_diffusion: LoadedModel) -> None:
    here = Decider(tiny_diffusion)
    assert decider.engine_process is not None and decider.engine_process.pid != os.getpid()
    for request in REQUESTS:
        assert_close(decider.decide(request)["answers"], here.decide(request)["answers"])


def test_a_bad_read_raises_here_and_the_engine_reads_on(decider: Decider) -> None:
    engine = decider.engine_process
    assert engine is not None
    good = ReadRequest(prompt=((2, 100, 200),), canvas=(300,) * 8, slots=(Slot(1, (400, 401)),), seed=3)
    with pytest.raises(ValueError, match="slot position 9 outside the canvas"):
        engine.read([ReadRequest(prompt=((2, 100),), canvas=(300,) * 8, slots=(Slot(9, (400,)),))])
    with pytest.raises(PromptTooLong) as too_long:  # an error of ours keeps its type and fields
        engine.read([ReadRequest(prompt=((5,) * (engine.max_tokens + 1),), canvas=(300,) * 8, slots=good.slots)])
    assert too_long.value.limit == engine.max_tokens
    (scores,) = engine.read([good])
    assert scores.logits[0].shape == (2,)
    assert engine.counters()  # the engine's counters came back with the reply


def test_a_model_that_does_not_load_is_named(tmp_path: Path, tiny_diffusion: LoadedModel) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        Decider(str(tmp_path / "no-such-model"), engine_process=True)
    with pytest.raises(TypeError, match="takes the model by name"):  # loaded weights stay in this process
        Decider(tiny_diffusion, engine_process=True)


def test_a_dead_engine_process_makes_the_server_answer_503_and_unready(tiny_diffusion_dir: Path) -> None:
    decider = Decider(str(tiny_diffusion_dir), dtype=torch.float32, engine_process=True)
    process = decider.engine_process
    assert process is not None
    with live_server(create_app(Settings(), decider)) as live, live.client() as client:
        assert client.post("/v1/systemone", json=REQUESTS[0]).status_code == 200
        assert client.get("/healthz").status_code == 200
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process.exit_code is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = client.post("/v1/systemone", json=REQUESTS[0])
        assert refused.status_code == 503 and "retry-after" in refused.headers
        reason = f"the engine's process ended (exit code {-signal.SIGKILL}): restart the server"
        assert refused.json()["detail"]["message"] == reason
        assert client.get("/readyz").json() == {"status": "not_ready", "reason": reason}
        health = client.get("/healthz")
        assert (health.status_code, health.json()["status"]) == (503, "engine_exited")
    with pytest.raises(EngineProcessExited, match="restart the server"):  # a read that was already past the door
        process.read([ReadRequest(prompt=((2, 100),), canvas=(300,) * 8, slots=(Slot(1, (400,)),))])
