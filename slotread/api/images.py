"""Images on the wire ⇄ decoded images placed in the state (``core.images.Image``).

Three ways in, all checked here and refused with a 422 located at the image:

* System One's ``images`` (vLLM's structured-decision example server): a list of ``data:image/...;base64,``
  URLs or ``{"content_type", "base64"}`` objects, shown ahead of the state, in order;
* System One's ``assets`` (the official client): ``{reference: {"type": "image", "part": "asset-N"}}``
  naming a part of a ``multipart/form-data`` body, or ``{"data_base64": ...}``; each reference, wherever
  it appears in the state's text (a string state, or any string inside a JSON state), is replaced by
  the image;
* OpenAI Decisions' ``input_image`` message parts (``api/decisions.py`` turns them into assets).

Formats: PNG, JPEG and WebP, recognised by their signatures (a declared content type is not
trusted). Limits (``ImageLimits``, from the server's settings): images per request, bytes per file
and decoded pixels per image; below the pixel cap the model's own image processor resizes each image
to its budget (``engines/diffusion_gemma/vision.py``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from slotread.core.images import Image
from slotread.errors import ErrorDetail, InvalidRequest

Loc = list[str | int]


@dataclass(frozen=True)
class ImageLimits:
    """How many images a request may carry, and how large each may be."""

    count: int = 8
    bytes: int = 5 * 2**20
    pixels: int = 4096 * 4096


DEFAULT_IMAGE_LIMITS = ImageLimits()


class WireImage(BaseModel):
    """An entry of System One's ``images``: base64 data and its content type."""

    model_config = ConfigDict(extra="forbid")

    content_type: str
    base64: str


class WireAsset(BaseModel):
    """An entry of System One's ``assets``: an image in a multipart part, or inline as base64."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image"] | None = None
    #: the format the client declares; the bytes decide
    format: str | None = None
    data_base64: str | None = None
    part: str | None = None


#: File signatures of the formats taken.
_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}
#: an image as a data URL; group 1 is its base64
DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,(.*)", re.DOTALL)


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _problem(loc: Loc, msg: str, kind: str = "value_error") -> InvalidRequest:
    return InvalidRequest.at(["body", *loc], msg, kind)


def decode_image(data: bytes, name: str, loc: Loc, limits: ImageLimits, offset: int = 0) -> Image:
    """Check one image file against ``limits`` and decode it to RGB; InvalidRequest naming it otherwise."""
    from PIL import Image as PilImage  # pillow: the server's, not the engines' (they take arrays)

    if not data:
        raise _problem(loc, f"image {name} is empty")
    if len(data) > limits.bytes:
        raise _problem(loc, f"image {name} has {len(data)} bytes; at most {limits.bytes} per image", "image_too_large")
    kind = _sniff(data)
    if kind is None:
        raise _problem(loc, f"image {name} is not a PNG, JPEG or WebP file", "image_format")
    try:
        with PilImage.open(io.BytesIO(data), formats=[kind]) as opened:
            width, height = opened.size
            if width * height > limits.pixels:
                msg = f"image {name} is {width}x{height} = {width * height} pixels; at most {limits.pixels}"
                raise _problem(loc, msg, "image_too_large")
            pixels = np.asarray(opened.convert("RGB"), dtype=np.uint8)
    except InvalidRequest:
        raise
    except Exception as exc:  # pillow raises OSError, SyntaxError, ValueError... for a broken file
        raise _problem(loc, f"image {name} cannot be decoded as {_FORMATS[kind]}: {exc}", "image_format") from None
    return Image(name, hashlib.sha256(data).digest(), pixels, offset)


def _base64(text: str, name: str, loc: Loc) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _problem(loc, f"image {name} is not valid base64") from None


def data_url_bytes(url: str, name: str, loc: Loc) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL; slotread fetches nothing from elsewhere."""
    match = DATA_URL.fullmatch(url)
    if match is None:
        msg = f"image {name} must be a data:image/...;base64, URL (slotread fetches no image from elsewhere)"
        raise _problem(loc, msg)
    return _base64(match[1], name, loc)


def listed_images(images: list[str | WireImage], limits: ImageLimits) -> list[Image]:
    """System One's ``images``, decoded, all ahead of the state."""
    check_count(len(images), limits)
    decoded = []
    for index, entry in enumerate(images):
        name = f"images[{index}]"
        loc: Loc = ["images", index]
        if isinstance(entry, str):
            data = data_url_bytes(entry, name, loc)
        else:
            data = _base64(entry.base64, name, [*loc, "base64"])
        decoded.append(decode_image(data, name, loc, limits))
    return decoded


def placed_assets(
    state: Any, assets: Mapping[str, WireAsset], parts: Mapping[str, bytes], limits: ImageLimits, listed: int = 0
) -> tuple[str, list[Image]]:
    """The state's text with every asset reference taken out, and the assets' images placed where their
    references were (with ``listed`` images ahead of the state, at most ``limits.count`` in all). Every
    asset must be referenced from the state, and every multipart part claimed by exactly one asset."""
    problems: list[ErrorDetail] = []
    claimed: dict[str, str] = {}
    files: dict[str, bytes] = {}
    for reference, asset in assets.items():
        loc: Loc = ["assets", reference]
        if not reference:
            problems.append(_problem(loc, "an asset's reference must not be empty").detail[0])
        elif asset.part is not None:
            if asset.part not in parts:
                problems.append(
                    _problem([*loc, "part"], f"asset {reference!r} names part {asset.part!r}, not sent").detail[0]
                )
            elif asset.part in claimed:
                msg = f"part {asset.part!r} is claimed by assets {claimed[asset.part]!r} and {reference!r}"
                problems.append(_problem([*loc, "part"], msg).detail[0])
            else:
                claimed[asset.part] = reference
                files[reference] = parts[asset.part]
        elif asset.data_base64 is not None:
            files[reference] = _base64(asset.data_base64, repr(reference), [*loc, "data_base64"])
        else:
            problems.append(_problem(loc, f"asset {reference!r} needs a part or data_base64").detail[0])
    problems += [
        _problem([name], f"part {name!r} is claimed by no asset").detail[0] for name in parts if name not in claimed
    ]
    if problems:
        raise InvalidRequest(problems)
    text, places = _take_references(state, [r for r in assets if r])
    for reference in assets:
        if reference and reference not in places:
            msg = (
                f"asset {reference!r} is not referenced from the state: slotread places an image where the state "
                "names it (question instructions and criteria take text only)"
            )
            problems.append(_problem(["assets", reference], msg).detail[0])
    if problems:
        raise InvalidRequest(problems)
    check_count(listed + sum(map(len, places.values())), limits)
    images = [
        decode_image(files[reference], repr(reference), ["assets", reference], limits, offset)
        for reference, offsets in places.items()
        for offset in offsets
    ]
    return text, sorted(images, key=lambda image: image.offset)


def _take_references(state: Any, references: list[str]) -> tuple[str, dict[str, list[int]]]:
    """The state as the model reads it (a string verbatim, JSON otherwise) with the references taken
    out, and where each one was (character offsets in the result)."""
    if isinstance(state, str):
        text, spelled = state, {r: r for r in references}
    else:
        text = json.dumps(state, ensure_ascii=False)
        spelled = {json.dumps(r, ensure_ascii=False)[1:-1]: r for r in references}  # as inside a JSON string
    if not spelled:
        return text, {}
    pattern = re.compile("|".join(re.escape(s) for s in sorted(spelled, key=len, reverse=True)))
    places: dict[str, list[int]] = {}
    pieces, start, removed = [], 0, 0
    for match in pattern.finditer(text):
        pieces.append(text[start : match.start()])
        places.setdefault(spelled[match[0]], []).append(match.start() - removed)
        removed += len(match[0])
        start = match.end()
    pieces.append(text[start:])
    return "".join(pieces), places


def check_count(count: int, limits: ImageLimits) -> None:
    """At most ``limits.count`` images (each place of a reference counts), checked before any is decoded."""
    if count > limits.count:
        raise _problem(["images"], f"at most {limits.count} images per request, got {count}", "too_many_images")


def new_reference() -> str:
    """A reference for an image that arrived without one (OpenAI ``input_image`` parts)."""
    return f"<image:{uuid.uuid4().hex}>"
