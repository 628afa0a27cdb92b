"""Read a request body: size limit on the wire, Content-Encoding (zstd, gzip), size limit again, JSON.

The official SDK zstd-compresses bodies of 1 KiB or more, so every decision route reads its body
here. Decompression is streamed with a bound on the output, so a small body that inflates to
gigabytes (a zip bomb) stops at ``max_bytes`` and is a 413, like an oversized plain body.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import zstandard
from starlette.requests import Request

from slotread.errors import BodyTooLarge, InvalidRequest, UnsupportedEncoding

_CHUNK = 64 * 1024


async def read_raw(request: Request, max_bytes: int) -> bytes:
    """The body as sent, refusing it as soon as it passes ``max_bytes`` (Content-Length is not trusted)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _gunzip(data: bytes, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip header and trailer
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidRequest.at(
            ["body"], f"the gzip body cannot be decompressed: {exc}", "decompression_error"
        ) from None
    if len(out) > max_bytes:
        raise BodyTooLarge(max_bytes)
    if not inflater.eof:
        raise InvalidRequest.at(["body"], "the gzip body is truncated", "decompression_error")
    return out


def _unzstd(data: bytes, max_bytes: int) -> bytes:
    # A frame's declared content size may be absent or lie; read in bounded steps instead.
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := reader.read(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(max_bytes)
            chunks.append(chunk)
    except zstandard.ZstdError as exc:
        raise InvalidRequest.at(
            ["body"], f"the zstd body cannot be decompressed: {exc}", "decompression_error"
        ) from None
    return b"".join(chunks)


def decode_content(data: bytes, content_encoding: str, max_bytes: int) -> bytes:
    """Undo each listed Content-Encoding, last applied first; refuse unknown ones before any work."""
    encodings = [e.strip().lower() for e in content_encoding.split(",") if e.strip()]
    for encoding in encodings:
        if encoding not in ("zstd", "gzip", "x-gzip", "identity"):
            raise UnsupportedEncoding(encoding)
    for encoding in reversed(encodings):
        if encoding == "zstd":
            data = _unzstd(data, max_bytes)
        elif encoding in ("gzip", "x-gzip"):
            data = _gunzip(data, max_bytes)
    return data


class _NonStandardConstant(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonStandardConstant(name)


def parse_json(data: bytes) -> Any:
    """The JSON value of a body; malformed JSON is a 422 located at the byte, as FastAPI reports it.

    NaN and Infinity are not JSON; Python's parser accepts them unless told otherwise.
    """
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except _NonStandardConstant as exc:
        raise InvalidRequest.at(["body"], f"{exc} is not a JSON value", "json_invalid") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest.at(["body", exc.start], "the body is not UTF-8", "json_invalid") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest.at(["body", exc.pos], f"JSON decode error: {exc.msg}", "json_invalid") from None
    except RecursionError:
        raise InvalidRequest.at(["body"], "JSON nested too deeply", "json_invalid") from None


async def read_json(request: Request, max_bytes: int) -> Any:
    """Read, decompress and parse a request body within ``max_bytes``."""
    raw = await read_raw(request, max_bytes)
    return parse_json(decode_content(raw, request.headers.get("content-encoding", ""), max_bytes))
