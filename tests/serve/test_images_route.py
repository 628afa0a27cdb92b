"""Images through the real server: the official client's multipart body, OpenAI ``input_image`` parts,
text-only models and ``--upstream`` refusing them, and ``/v1/models`` saying which models take them."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import pytest
from PIL import Image as PilImage
from typesafe_sdk import Choice, Image, Noul, RetryPolicy, TypeSafeClient, TypeSafeUnprocessableEntityError

from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.engines.remote.replicas import Replica
from tests.serve.live import Live, live_server


def png(colour: tuple[int, int, int], size: int = 48) -> bytes:
    buffer = io.BytesIO()
    PilImage.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def diffusion_server(tiny_diffusion: LoadedModel) -> Iterator[Live]:
    settings = Settings(max_images=2)
    with live_server(create_app(settings, Decider(tiny_diffusion, image_limits=settings.image_limits))) as live:
        yield live


def test_the_official_client_sends_an_image_question_as_multipart_and_parses_the_answer(
    diffusion_server: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TYPESAFE_BASE_URL", diffusion_server.url)
    monkeypatch.setenv("TYPESAFE_API_KEY", "any-key-auth-is-off")
    sent: list[httpx2.Request] = []
    recorder = httpx2.Client(timeout=60.0, event_hooks={"request": [sent.append]})
    # a noisy photo: a body over 1 KiB, which the client compresses
    noise = (np.random.default_rng(0).random((48, 48, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    PilImage.fromarray(noise).save(buffer, format="PNG")
    photo = Image(buffer.getvalue())
    with TypeSafeClient(http_client=recorder, retry=RetryPolicy(max_retries=0)) as client:
        result = client.system_one(
            state={"photo": photo, "caption": "a square"},
            questions={
                "red": Noul(instructions="Is the square red?"),
                "colour": Choice(
                    instructions="Which colour is it?", criteria={"red": None, "green": None, "blue": None}
                ),
            },
        )
        names = [model.name for model in client.models.list().models]
    with diffusion_server.client() as raw:
        listed = raw.get("/v1/models").json()["models"]
    assert sent[0].headers["content-type"].startswith("multipart/form-data")
    assert sent[0].headers["content-encoding"] == "zstd"  # the client compresses the multipart body too
    assert 0 <= result.nouls["red"].noul <= 1
    assert abs(sum(result.choices["colour"].probabilities.values()) - 1) < 1e-9
    # the image's soft tokens count as input tokens: far more than the text alone
    assert result.usage.input_tokens > 2 * 200
    assert [(model["name"], model["x_images"]) for model in listed] == [(name, True) for name in names]
    counters = diffusion_server.app.state.service.decider.engine.engine.counters()
    assert counters["vision_runs"] == 1  # two questions, one run of the vision tower


def test_openai_input_image_parts_and_image_limits_through_the_server(diffusion_server: Live) -> None:
    url = "data:image/png;base64," + base64.b64encode(png((0, 0, 200))).decode()
    body = {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": url}],
            }
        ],
        "questions": [{"type": "predicate", "instructions": "Is the square blue?"}],
    }
    with diffusion_server.client() as client:
        answered = client.post("/v1/decisions", json=body)
        too_many = client.post(
            "/v1/systemone", json={"state": "s", "images": [url] * 3, "questions": {"q": {"type": "noul"}}}
        )
    assert answered.status_code == 200, answered.text
    assert 0 <= answered.json()["answers"][0]["probability"] <= 1
    assert too_many.status_code == 422
    assert too_many.json()["detail"][0]["loc"] == ["body", "images"]


def test_a_text_only_model_refuses_images_naming_itself(smollm2_server: Live) -> None:
    photo = png((1, 2, 3))
    with smollm2_server.client() as client:
        refused = client.post(
            "/v1/systemone",
            json={
                "state": "x",
                "images": ["data:image/png;base64," + base64.b64encode(photo).decode()],
                "questions": {"q": {"type": "noul"}},
            },
        )
        models = client.get("/v1/models").json()["models"]
    assert refused.status_code == 422
    detail = refused.json()["detail"][0]
    assert "smollm2-135m-instruct" in detail["msg"] and "reads text only" in detail["msg"]
    assert detail["type"] == "images_not_supported"
    assert [model["x_images"] for model in models] == [False, False]


def test_the_official_client_gets_a_typed_422_from_a_text_only_model(
    smollm2_server: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TYPESAFE_BASE_URL", smollm2_server.url)
    monkeypatch.setenv("TYPESAFE_API_KEY", "any-key-auth-is-off")
    with TypeSafeClient(retry=RetryPolicy(max_retries=0)) as client, pytest.raises(TypeSafeUnprocessableEntityError):
        client.system_one(state=Image(png((9, 9, 9))), questions={"q": Noul(instructions="Dark?")})


def test_images_through_upstream_are_refused_with_the_reason(
    diffusion_replicas: list[Replica], tiny_diffusion_dir: Path
) -> None:
    decider = Decider(str(tiny_diffusion_dir), upstreams=[diffusion_replicas[0].url], health_interval_s=60.0)
    try:
        url = "data:image/png;base64," + base64.b64encode(png((5, 5, 5))).decode()
        with pytest.raises(Exception) as caught:
            decider.decide({"state": "s", "images": [url], "questions": {"q": {"type": "noul"}}})
    finally:
        decider.close()
    assert "--upstream" in str(caught.value) and "completions" in str(caught.value)
    assert caught.value.detail[0]["type"] == "images_not_supported"  # type: ignore[attr-defined]
