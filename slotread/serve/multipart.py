"""A decision body that may carry images: JSON, or the official client's ``multipart/form-data``.

The official System One client sends a request with images as a multipart body (RFC 7578): a JSON part
named ``request``, then one part per image file, ``asset-0``, ``asset-1``... that the JSON's
``assets`` name (it may also send ``TypeSafe-Danger-Zone-Images: true``, which changes nothing here).
The whole body may be zstd- or gzip-encoded, as any body.

Images make bodies large, so the wire limit is ``max_body_bytes`` plus room for ``max_images`` files
of ``max_image_bytes`` (as base64, the larger form); a body over ``max_body_bytes`` that turns out to
carry no image is still a 413.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Depends, Request

from slotread.errors import BodyTooLarge, InvalidRequest
from slotread.serve.body import decode_content, parse_json, read_raw
from slotread.serve.deps import ServiceDep
from slotread.settings import Settings

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?')
_NAME = re.compile(rb'\bname="([^"]*)"')


def body_limit(settings: Settings) -> int:
    """The most bytes a decision body may have on the wire and decoded, images included."""
    return settings.max_body_bytes + settings.max_images * (settings.max_image_bytes * 4 // 3 + 4096)


def split_multipart(data: bytes, content_type: str) -> dict[str, bytes]:
    """The parts of a ``multipart/form-data`` body by name; a malformed body is a 422."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise InvalidRequest.at(["body"], "a multipart body needs a boundary in its content-type", "multipart_invalid")
    delimiter = b"--" + match[1].encode("latin-1")
    chunks = data.split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise InvalidRequest.at(
            ["body"], "the multipart body does not end with its closing boundary", "multipart_invalid"
        )
    parts: dict[str, bytes] = {}
    for chunk in chunks[1:-1]:
        head, found, content = chunk.partition(b"\r\n\r\n")
        name = _NAME.search(head)
        if not found or name is None or not content.endswith(b"\r\n"):
            raise InvalidRequest.at(["body"], "a multipart part has no name or no content", "multipart_invalid")
        key = name[1].decode("utf-8", "replace")
        if key in parts:
            raise InvalidRequest.at(["body", key], f"part {key!r} is sent twice", "multipart_invalid")
        parts[key] = content[:-2]
    return parts


def _carries_images(body: Any, parts: dict[str, bytes]) -> bool:
    """Whether a body holds image fields (System One ``images``/``assets``, OpenAI ``input_image`` parts)."""
    if parts:
        return True
    if not isinstance(body, dict):
        return False
    if body.get("images") or body.get("assets"):
        return True
    messages = body.get("input")
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image"
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


async def read_decision_body(request: Request, settings: Settings) -> tuple[Any, dict[str, bytes]]:
    """The JSON body and the files of a multipart body by part name (none for a JSON body)."""
    limit = body_limit(settings)
    data = decode_content(await read_raw(request, limit), request.headers.get("content-encoding", ""), limit)
    content_type = request.headers.get("content-type", "")
    parts: dict[str, bytes] = {}
    if content_type.lower().startswith("multipart/form-data"):
        parts = split_multipart(data, content_type)
        if "request" not in parts:
            raise InvalidRequest.at(
                ["body"], "the multipart body has no JSON part named 'request'", "multipart_invalid"
            )
        data = parts.pop("request")
    body = parse_json(data)
    if len(data) > settings.max_body_bytes and not _carries_images(body, parts):
        raise BodyTooLarge(settings.max_body_bytes)
    return body, parts


async def _decision_body(request: Request, service: ServiceDep) -> tuple[Any, dict[str, bytes]]:
    return await read_decision_body(request, service.settings)


#: a decision route's body and its multipart files (``read_decision_body``)
DecisionBody = Annotated[tuple[Any, dict[str, bytes]], Depends(_decision_body)]
