"""Images on the wire: System One's ``images`` and ``assets``, OpenAI ``input_image`` parts, and their limits."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image as PilImage

from slotread.api import decisions, systemone
from slotread.api.images import ImageLimits
from slotread.core.questions import Decision
from slotread.errors import InvalidRequest
from slotread.serve.multipart import split_multipart

QUESTIONS = {"q": {"type": "noul"}}


def image_file(
    kind: str = "PNG", size: tuple[int, int] = (20, 10), colour: tuple[int, int, int] = (200, 10, 10)
) -> bytes:
    buffer = io.BytesIO()
    PilImage.new("RGB", size, colour).save(buffer, format=kind)
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def decision(body: dict[str, Any], parts: dict[str, bytes] | None = None, **limits: int) -> Decision:
    return systemone.to_decision(systemone.parse_request(body), image_limits=ImageLimits(**limits), parts=parts)


def problems(body: dict[str, Any], parts: dict[str, bytes] | None = None, **limits: int) -> list[dict[str, Any]]:
    with pytest.raises(InvalidRequest) as caught:
        decision(body, parts, **limits)
    return list(caught.value.detail)


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP"])
def test_images_ahead_of_the_state_decode_to_rgb_pixels(kind: str) -> None:
    data = image_file(kind)
    body = {
        "state": "a red flag",
        "images": [data_url(data), {"content_type": "image/x", "base64": base64.b64encode(data).decode()}],
        "questions": QUESTIONS,
    }
    found = decision(body)
    assert found.state == "a red flag"
    assert [(image.name, image.offset) for image in found.images] == [("images[0]", 0), ("images[1]", 0)]
    pixels = found.images[0].pixels
    assert pixels.shape == (10, 20, 3) and pixels.dtype == np.uint8
    assert abs(int(pixels[5, 5, 0]) - 200) <= 3  # lossy formats stay close
    assert found.images[0].digest == found.images[1].digest


def test_asset_references_are_replaced_where_the_state_names_them() -> None:
    red, blue = image_file(colour=(255, 0, 0)), image_file(colour=(0, 0, 255))
    body = {
        "state": "before <image:a> middle <image:b> end <image:a>",
        "assets": {
            "<image:a>": {"type": "image", "part": "asset-0"},
            "<image:b>": {"type": "image", "part": "asset-1"},
        },
        "questions": QUESTIONS,
    }
    found = decision(body, {"asset-0": red, "asset-1": blue})
    assert found.state == "before  middle  end "
    assert [(image.name, image.offset) for image in found.images] == [
        ("'<image:a>'", 7),
        ("'<image:b>'", 15),
        ("'<image:a>'", 20),
    ]
    # inside a JSON state, as the official client sends an Image placed in a dict
    json_body = {
        "state": {"photo": "ref1", "note": "x"},
        "assets": {"ref1": {"data_base64": base64.b64encode(red).decode()}},
    }
    found = decision({**json_body, "questions": QUESTIONS})
    assert found.state == '{"photo": "", "note": "x"}'
    assert found.images[0].offset == len('{"photo": "')


def test_every_image_problem_is_a_422_naming_the_image() -> None:
    png = image_file()
    cases = [
        ({"images": ["https://example.com/x.png"]}, ["body", "images", 0], "data:image"),
        ({"images": ["data:image/png;base64,@@@"]}, ["body", "images", 0], "base64"),
        ({"images": [data_url(b"GIF89a" + b"\0" * 20)]}, ["body", "images", 0], "PNG, JPEG or WebP"),
        ({"images": [data_url(png[:40])]}, ["body", "images", 0], "cannot be decoded"),
        ({"images": [data_url(image_file(size=(300, 300)))]}, ["body", "images", 0], "pixels"),
        ({"images": [data_url(png)] * 3}, ["body", "images"], "at most 2 images"),
        ({"assets": {"r": {"data_base64": base64.b64encode(png).decode()}}}, ["body", "assets", "r"], "not referenced"),
        ({"assets": {"s": {"type": "image"}}, "state": "s"}, ["body", "assets", "s"], "needs a part"),
    ]
    for extra, loc, words in cases:
        found = problems({"state": "text", "questions": QUESTIONS, **extra}, count=2, pixels=200 * 200)
        assert found[0]["loc"] == loc, (extra, found)
        assert words in found[0]["msg"], found
    big = {"state": "text", "images": [data_url(png)], "questions": QUESTIONS}
    assert "bytes" in problems(big, bytes=len(png) - 1)[0]["msg"]
    # multipart: a named part that was not sent, and a part no asset claims
    named = {"state": "s", "assets": {"s": {"part": "asset-9"}}, "questions": QUESTIONS}
    assert problems(named, {"asset-0": png})[0]["loc"] == ["body", "assets", "s", "part"]
    assert ["body", "asset-0"] in [p["loc"] for p in problems(named, {"asset-0": png})]


def test_openai_input_image_parts_become_assets_where_they_stand() -> None:
    png = image_file()
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look:"},
                    {"type": "input_image", "image_url": data_url(png)},
                ],
            }
        ],
        "questions": [{"type": "predicate", "instructions": "Is it red?"}],
    }
    wire = decisions.to_systemone(decisions.parse_request(body))
    reference = "<input[0].content[1]>"
    assert wire["state"] == f"Look:\n\n{reference}" and set(wire["assets"]) == {reference}
    found = decision(wire)
    assert found.state == "Look:\n\n" and found.images[0].offset == len("Look:\n\n")
    remote = {
        **body,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": "https://x/y.png"}}]}],
    }
    with pytest.raises(InvalidRequest) as caught:
        decisions.to_systemone(decisions.parse_request(remote))
    assert caught.value.detail[0]["loc"] == ["body", "input", 0, "content", 0, "image_url"]


def test_a_multipart_body_splits_into_its_named_parts() -> None:
    png = image_file()
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n'.encode()
        + b'{"state": "x"}\r\n'
        + f'--{boundary}\r\nContent-Disposition: form-data; name="asset-0"; filename="asset-0"\r\n'.encode()
        + b"Content-Type: image/png\r\n\r\n"
        + png
        + f"\r\n--{boundary}--\r\n".encode()
    )
    parts = split_multipart(body, f"multipart/form-data; boundary={boundary}")
    assert parts == {"request": b'{"state": "x"}', "asset-0": png}
    with pytest.raises(InvalidRequest):
        split_multipart(body[:-5], f"multipart/form-data; boundary={boundary}")
