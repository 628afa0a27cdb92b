"""Give every response an ``x-typesafe-request-id`` header.

The id is made here and kept in the request's state (``scope["state"]["request_id"]``), so a route
can replace it with the client's own (vLLM's ``request_id`` body field) and the 500 handler, which
runs outside this middleware, can still send it.
"""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-typesafe-request-id"
#: what a client-given id may look like to be echoed in a header (no spaces, no control characters)
_ECHOABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def new_request_id() -> str:
    """A fresh request id."""
    return f"req_{uuid.uuid4().hex}"


def is_echoable(value: object) -> bool:
    """Whether a client-given request id is safe to send back as a header value."""
    return isinstance(value, str) and _ECHOABLE.fullmatch(value) is not None


def request_id_of(scope: Scope) -> str:
    """The request id of a request this middleware has seen (a fresh one otherwise)."""
    state = scope.setdefault("state", {})
    return str(state.setdefault("request_id", new_request_id()))


class RequestIdMiddleware:
    """Assigns the request id and adds its header to the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id_of(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if HEADER not in headers:
                    headers[HEADER] = request_id_of(scope)
            await send(message)

        await self.app(scope, receive, send_with_id)
