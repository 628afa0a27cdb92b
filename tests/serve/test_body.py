"""Request bodies: Content-Encoding, size limits before and after decompression, JSON."""

import gzip

import pytest
import zstandard

from slotread.errors import BodyTooLarge, InvalidRequest, UnsupportedEncoding
from slotread.serve.body import decode_content, parse_json

DATA = b'{"state": "s", "questions": {}}' * 10


@pytest.mark.parametrize(
    ("encoding", "encoded"),
    [
        ("", DATA),
        ("identity", DATA),
        ("gzip", gzip.compress(DATA)),
        ("x-gzip", gzip.compress(DATA)),
        ("zstd", zstandard.ZstdCompressor().compress(DATA)),
        ("ZSTD", zstandard.ZstdCompressor().compress(DATA)),
        ("gzip, zstd", zstandard.ZstdCompressor().compress(gzip.compress(DATA))),
    ],
)
def test_each_encoding_is_undone(encoding: str, encoded: bytes) -> None:
    assert decode_content(encoded, encoding, 10_000) == DATA


def test_a_zstd_frame_without_a_declared_size_is_read_in_bounded_steps() -> None:
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(DATA)
    assert decode_content(streamed, "zstd", 10_000) == DATA


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("gzip", gzip.compress), ("zstd", zstandard.ZstdCompressor().compress)],
)
def test_a_zip_bomb_stops_at_the_limit(encoding: str, compress: object) -> None:
    bomb = compress(b"\0" * 50_000_000)  # type: ignore[operator]
    assert len(bomb) < 100_000
    with pytest.raises(BodyTooLarge):
        decode_content(bomb, encoding, 1_000_000)


@pytest.mark.parametrize("encoding", ["br", "deflate", "compress", "gzip, br"])
def test_an_unknown_encoding_is_refused_before_any_work(encoding: str) -> None:
    with pytest.raises(UnsupportedEncoding):
        decode_content(b"not even compressed", encoding, 1000)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_corrupt_body_is_a_422(encoding: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_content(b"\x1f\x8b\x08garbage" if encoding == "gzip" else b"\x28\xb5\x2f\xfdgarbage", encoding, 1000)
    assert caught.value.detail[0]["loc"] == ["body"]


def test_a_truncated_gzip_body_is_a_422() -> None:
    with pytest.raises(InvalidRequest):
        decode_content(gzip.compress(DATA)[:-12], "gzip", 10_000)


@pytest.mark.parametrize(
    ("text", "loc"),
    [(b'{"state": ', ["body", 10]), (b"\xff\xfe", ["body", 0]), (b'{"x": NaN}', ["body"]), (b"[" * 100_000, ["body"])],
)
def test_malformed_json_is_a_422_located_in_the_body(text: bytes, loc: list[object]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_json(text)
    assert caught.value.detail[0]["loc"] == loc
    assert caught.value.detail[0]["type"] == "json_invalid"
