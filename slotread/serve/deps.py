"""The routes' dependencies, defined once: the decision service, the auth check and the JSON body."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from slotread.serve.auth import authenticate
from slotread.serve.body import read_json
from slotread.serve.service import DecisionService

# The dependencies are coroutines although they never wait: FastAPI runs a plain function's dependency
# in its thread pool, two thread hand-offs per request on the event loop's thread.


async def _service(request: Request) -> DecisionService:
    service = request.app.state.service
    if not isinstance(service, DecisionService):
        raise TypeError("the app was not built by create_app")
    return service


ServiceDep = Annotated[DecisionService, Depends(_service)]


async def _authorize(request: Request, service: ServiceDep) -> None:
    authenticate(service.api_keys, request.headers)


#: add to a router's ``dependencies``: the request must carry a known API key when auth is on
Authorized = Depends(_authorize)


async def _json_body(request: Request, service: ServiceDep) -> Any:
    return await read_json(request, service.settings.max_body_bytes)


#: the request body, decompressed and parsed within the size limit
JsonBody = Annotated[Any, Depends(_json_body)]
