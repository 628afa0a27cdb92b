"""The app factory: ``create_app(settings, decider)``, its lifespan, and one handler per error type.

Error bodies follow DESIGN.md section 5: validation problems are 422 ``{"detail": [{loc, msg,
type}]}``, everything else ``{"detail": {"error_type", "message"}}``. A bad request never gets a
5xx (clients retry those): every check on caller input raises one of our 4xx types. A bug is a 500
with a plain body; Starlette re-raises it after answering, so the server logs the traceback.

``decider`` may be a ready Decider or a function that builds one: the factory form loads the model
in the lifespan, in a thread, so ``/healthz`` answers at once and ``/readyz`` says 503 until the
model is loaded (a first start fetches and converts it, which takes minutes).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from slotread.decider import Decider
from slotread.errors import (
    AuthenticationFailed,
    BodyTooLarge,
    EngineFault,
    InvalidRequest,
    NotReady,
    Overloaded,
    PromptTooLong,
    UnknownModel,
    UnsupportedEncoding,
    UpstreamError,
    UpstreamUnavailable,
)
from slotread.serve.admission import ClientGone
from slotread.serve.auth import ApiKeys
from slotread.serve.metrics import Metrics, MetricsMiddleware
from slotread.serve.openapi import add_schemas
from slotread.serve.request_id import HEADER, RequestIdMiddleware, request_id_of
from slotread.serve.routes import chat, decisions, models, operations, playground, systemone
from slotread.serve.service import DecisionService
from slotread.settings import Settings

logger = logging.getLogger(__name__)

#: how long a not-ready server asks clients to wait
_NOT_READY_RETRY_S = 5.0
#: nginx's status for "client closed the request": nobody reads it, the logs and metrics do
_CLIENT_CLOSED = 499


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status, headers=headers)


def _retry_headers(seconds: float) -> dict[str, str]:
    # retry-after takes whole seconds; the SDK prefers retry-after-ms when both are present.
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return JSONResponse({"detail": exc.detail}, 422)


async def _validation_error(request: Request, exc: Exception) -> Response:
    # FastAPI's own validation (query parameters and the like): the same shape as ours, without
    # echoing the input back, which could be large.
    assert isinstance(exc, RequestValidationError)
    detail = [{"loc": list(e["loc"]), "msg": str(e["msg"]), "type": str(e["type"])} for e in exc.errors()]
    return JSONResponse({"detail": detail}, 422)


async def _unknown_model(request: Request, exc: Exception) -> Response:
    return _error(404, "not_found_error", str(exc))


async def _too_large(request: Request, exc: Exception) -> Response:
    return _error(413, "request_too_large", str(exc))


async def _unsupported_encoding(request: Request, exc: Exception) -> Response:
    return _error(415, "unsupported_media_type", str(exc))


async def _authentication_failed(request: Request, exc: Exception) -> Response:
    return _error(401, "authentication_error", str(exc), {"www-authenticate": "Bearer"})


async def _overloaded(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Overloaded)
    return _error(529, "overloaded_error", str(exc), _retry_headers(exc.retry_after))


async def _not_ready(request: Request, exc: Exception) -> Response:
    return _error(503, "not_ready_error", str(exc), _retry_headers(_NOT_READY_RETRY_S))


async def _upstream_unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UpstreamUnavailable)
    return _error(503, "upstream_unavailable_error", str(exc), _retry_headers(exc.retry_after))


async def _upstream_error(request: Request, exc: Exception) -> Response:
    # The gateway and a replica disagree on the wire: our bug, not the caller's, and not transient.
    logger.error("upstream error: %s", exc)
    return _error(502, "upstream_error", str(exc))


async def _engine_fault(request: Request, exc: Exception) -> Response:
    # Our bug (the engine or the model), not the caller's: a 500 that says so, and the log keeps the trace.
    logger.error("engine fault: %s", exc, exc_info=exc)
    return _error(500, "engine_error", str(exc))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return _error(_CLIENT_CLOSED, "client_closed_request", "the client disconnected before its turn")


_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "method_not_allowed_error",
    413: "request_too_large",
    415: "unsupported_media_type",
}


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own errors (no such route, wrong method) in our error shape.
    assert isinstance(exc, HTTPException)
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    return _error(exc.status_code, error_type, str(exc.detail), dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Runs outside the request-id middleware, so it sets the header itself; Starlette re-raises
    # the exception after this response is sent and the server logs its traceback.
    return PlainTextResponse("Internal Server Error", 500, headers={HEADER: request_id_of(request.scope)})


def create_app(settings: Settings, decider: Decider | Callable[[], Decider]) -> FastAPI:
    """The server app for ``decider`` (or a function that loads one), configured by ``settings``."""
    api_keys = ApiKeys.from_file(settings.api_keys) if settings.api_keys is not None else None
    metrics = Metrics()
    service = DecisionService(settings, metrics, api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        loading = None
        if isinstance(decider, Decider):
            service.serve(decider)
        else:
            loading = asyncio.create_task(service.load(decider))
        logger.info("auth is %s", f"on ({len(api_keys)} keys)" if api_keys else "off")
        try:
            yield
        finally:
            # The server has stopped taking requests and answered those in flight; let the pool drain.
            if loading is not None and not loading.done():
                loading.cancel()
            await asyncio.to_thread(service.stop)

    # The documentation pages load swagger-ui and redoc from the server itself, not a CDN: they work offline.
    app = FastAPIOffline(
        title="slotread",
        summary="Typed answers with probabilities, read from a language model's answer slots in one pass.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.service = service
    app.include_router(systemone.router)
    app.include_router(decisions.router)
    app.include_router(chat.router)
    app.include_router(models.router)
    app.include_router(operations.router)
    if settings.playground:
        app.include_router(playground.router)

    handlers: dict[type[Exception], Callable[[Request, Exception], Any]] = {
        InvalidRequest: _invalid_request,
        RequestValidationError: _validation_error,
        UnknownModel: _unknown_model,
        PromptTooLong: _too_large,
        BodyTooLarge: _too_large,
        UnsupportedEncoding: _unsupported_encoding,
        AuthenticationFailed: _authentication_failed,
        Overloaded: _overloaded,
        NotReady: _not_ready,
        UpstreamUnavailable: _upstream_unavailable,
        UpstreamError: _upstream_error,
        EngineFault: _engine_fault,
        ClientGone: _client_gone,
        HTTPException: _http_error,
        Exception: _internal_error,
    }
    for error, handler in handlers.items():
        app.add_exception_handler(error, handler)
    # Added last, so outermost: the metrics see every status, the id is on every response.
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    schemas = {**systemone.SCHEMAS, **decisions.SCHEMAS, **chat.SCHEMAS}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = add_schemas(document, schemas)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
