"""API keys: loaded from a file as sha256 digests, checked in constant time, never logged.

The file holds one key per line, either the key itself or ``sha256:<64 hex digits>`` of it; blank
lines and lines starting with ``#`` are skipped. Only digests are kept in memory. A request carries
its key as ``Authorization: Bearer <key>`` (what the official SDK sends) or as ``x-api-key``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from starlette.datastructures import Headers

from slotread.errors import AuthenticationFailed

_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """The sha256 digests of the accepted keys."""

    def __init__(self, digests: list[bytes]) -> None:
        if not digests:
            raise ValueError("an API key file must hold at least one key")
        self._digests = tuple(digests)

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        """Read a key file; raises ValueError (naming the line, never the key) if it holds none."""
        digests = []
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = line.strip()
            if not entry or entry.startswith("#"):
                continue
            match = _DIGEST.fullmatch(entry)
            digests.append(bytes.fromhex(match.group(1)) if match else _digest(entry))
        if not digests:
            raise ValueError(f"{path} holds no API keys")
        return cls(digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of ours; compares every digest so the time does not depend on which."""
        digest = _digest(key)
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found


def presented_key(headers: Headers) -> str | None:
    """The key a request carries, from ``Authorization: Bearer`` or ``x-api-key``."""
    authorization = headers.get("authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return headers.get("x-api-key") or None


def authenticate(keys: ApiKeys | None, headers: Headers) -> None:
    """Pass if auth is off or the request carries a known key; raise AuthenticationFailed otherwise."""
    if keys is None:
        return
    key = presented_key(headers)
    if key is None:
        raise AuthenticationFailed("an API key is required: send 'Authorization: Bearer <key>' or 'x-api-key'")
    if not keys.accepts(key):
        raise AuthenticationFailed("the API key is not valid")
