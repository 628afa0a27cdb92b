"""API keys: stored as sha256 digests, read from Bearer or x-api-key (no model; the live checks are in test_app)."""

import hashlib
from pathlib import Path

import pytest
from starlette.datastructures import Headers

from slotread.errors import AuthenticationFailed
from slotread.serve.auth import ApiKeys, authenticate, presented_key


def key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_keys_and_digests_are_both_accepted_and_only_digests_are_kept(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"second-key").hexdigest()
    keys = ApiKeys.from_file(key_file(tmp_path, f"# operators\n first-key \n\nsha256:{digest.upper()}\n"))
    assert len(keys) == 2
    assert keys.accepts("first-key") and keys.accepts("second-key")
    assert not keys.accepts("first-key ") and not keys.accepts("") and not keys.accepts(digest)
    assert "first-key" not in repr(vars(keys))


def test_a_file_without_keys_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no API keys"):
        ApiKeys.from_file(key_file(tmp_path, "# nothing here\n\n"))


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"authorization": "Bearer abc"}, "abc"),
        ({"authorization": "bearer   abc  "}, "abc"),
        ({"x-api-key": "abc"}, "abc"),
        ({"authorization": "Basic abc"}, None),
        ({"authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_the_key_comes_from_bearer_or_x_api_key(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(Headers(headers)) == key


def test_authenticate_passes_everything_when_off_and_names_the_problem_when_on(tmp_path: Path) -> None:
    authenticate(None, Headers({}))
    authenticate(None, Headers({"authorization": "Bearer anything"}))
    keys = ApiKeys.from_file(key_file(tmp_path, "good\n"))
    authenticate(keys, Headers({"x-api-key": "good"}))
    with pytest.raises(AuthenticationFailed, match="required"):
        authenticate(keys, Headers({}))
    with pytest.raises(AuthenticationFailed, match="not valid") as caught:
        authenticate(keys, Headers({"authorization": "Bearer bad-key"}))
    assert "bad-key" not in str(caught.value)
