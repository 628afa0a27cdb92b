"""API keys: stored as sha256 digests, read from Bearer or x-api-key; auth on and off on the real server."""

import hashlib
import logging
from pathlib import Path

import pytest
from starlette.datastructures import Headers

from slotread.decider import Decider
from slotread.errors import AuthenticationFailed
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.serve.auth import ApiKeys, authenticate, presented_key
from slotread.settings import Settings
from tests.serve.live import Live, live_server


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


REQUEST = {"state": "the server is down", "questions": {"urgent": {"type": "noul"}}}


def test_with_a_key_file_the_server_wants_a_known_key(
    smollm2: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    digest = hashlib.sha256(b"secret-two").hexdigest()
    settings = Settings(api_keys=key_file(tmp_path, f"secret-one\nsha256:{digest}\n"))
    caplog.set_level(logging.DEBUG)
    with live_server(create_app(settings, Decider(smollm2))) as live, live.client() as client:
        missing = client.post("/v1/systemone", json=REQUEST)
        wrong = client.post("/v1/systemone", json=REQUEST, headers={"authorization": "Bearer secret-three"})
        models = client.get("/v1/models")
        decisions = client.post("/v1/decisions", json={"input": "x", "questions": [{"type": "predicate"}]})
        bearer = client.post("/v1/systemone", json=REQUEST, headers={"authorization": "Bearer secret-one"})
        header = client.post("/v1/systemone", json=REQUEST, headers={"x-api-key": "secret-two"})
        open_routes = [client.get(path) for path in ("/healthz", "/readyz", "/metrics", "/openapi.json")]
    for refused in (missing, wrong, models, decisions):
        assert refused.status_code == 401
        assert refused.json()["detail"]["error_type"] == "authentication_error"
        assert refused.headers["x-typesafe-request-id"]
    assert bearer.status_code == 200 and header.status_code == 200
    assert all(response.status_code == 200 for response in open_routes)
    assert "secret-one" not in caplog.text and "secret-three" not in caplog.text


def test_without_a_key_file_any_or_no_authorization_is_accepted(smollm2_server: Live) -> None:
    with smollm2_server.client() as client:
        for headers in ({}, {"authorization": "Bearer whatever"}, {"authorization": "Basic Zm9vOmJhcg=="}):
            assert client.post("/v1/systemone", json=REQUEST, headers=headers).status_code == 200
