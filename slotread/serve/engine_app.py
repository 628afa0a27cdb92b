"""The engine server (``slotread engine``): one model's slot reads over vLLM's completions API.

Routes: ``POST /v1/completions`` (the subset structured reads use; ``engines/remote/wire.py`` is the
contract), ``GET /v1/models`` in vLLM's listing shape, and ``GET /healthz`` (also ``/health``,
vLLM's path, so one health check serves both kinds of replica). The model is loaded before the
server listens: a server that answers is ready.

A request is one read, or several (a ``prompt`` list of prompts, vLLM's batch form: a gateway sends
the reads of one decision stage so, ``wire.batch_body``), which go to the engine in one call. Reads
run in worker threads through a ``BatchingEngine``: the reads that arrive while the engine is busy
go to it together in its next call, which the engine contract makes exact up to float rounding;
a call takes about a second of reads at most (``batcher.MAX_CALL_S``), as each read waits for its
whole call. A request whose client hangs up before its reads' call starts (a gateway whose decision
passed its deadline) is not read at all: a replica that has fallen behind would otherwise spend
itself on answers nobody reads, and fall further behind (the client gets no answer; the log says 499).

Errors take vLLM's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a body that
breaks the contract (malformed JSON included), 404 for another model's name or an unknown route,
413 for a body over the limit, 415 for an unknown Content-Encoding. A bug is Starlette's plain 500,
and its traceback is logged.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from transformers import PreTrainedModel

from slotread.decider import make_engine
from slotread.engines.base import Engine
from slotread.engines.remote.wire import completion_response, parse_completions, read_request
from slotread.errors import BodyTooLarge, InvalidRequest, ReadAbandoned, UnknownModel, UnsupportedEncoding, WireError
from slotread.models.load import LoadedModel, load_model
from slotread.serve.batcher import MAX_CALL_S, BatchingEngine
from slotread.serve.body import read_json
from slotread.settings import EngineSettings

#: A body holds token ids only: 8 MiB is over a million of them, past any model's context.
MAX_BODY_BYTES = 8 * 2**20
#: what nginx logs for a request whose client closed the connection first
CLIENT_CLOSED = 499
#: Requests (a read each, or a gateway's batch) waiting to be merged into the engine's next call,
#: besides those in the call running now. The engines cut a call into forwards of 32 rows, so 64
#: keeps the next forward full.
READ_THREADS = 64


@dataclass(frozen=True)
class ServedEngine:
    """The engine a server reads with, its model's name, and the vocabulary bodies are checked against."""

    name: str
    engine: Engine
    vocab_size: int

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        deterministic: bool = False,
        cache_bytes: int | None = None,
        max_batch: int | None = None,
        slow_paths: Sequence[str] = (),
    ) -> ServedEngine:
        """The in-process engine of a loaded model (``make_engine``)."""
        engine = make_engine(loaded, cache_bytes, max_batch, deterministic, slow_paths)
        assert isinstance(loaded.model, PreTrainedModel), "make_engine reads transformers models only"
        return cls(loaded.name, engine, int(loaded.model.config.get_text_config().vocab_size))

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ServedEngine:
        """Load the model ``settings`` name and its engine (``slotread engine``)."""
        dtype = getattr(torch, settings.dtype)
        loaded = load_model(settings.model, cache_dir=settings.cache_dir, device=settings.device, dtype=dtype)
        return cls.from_loaded(
            loaded, settings.deterministic, settings.prefix_cache_bytes, settings.max_batch, settings.slow_paths
        )


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = HTTPStatus(status).phrase.title().replace(" ", "") + "Error"  # 400: BadRequestError, as vLLM
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


async def _wire_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, WireError)
    return _error(400, exc.message, exc.param)


#: our errors other than WireError that a request can cause, and their status
_STATUS: dict[type[Exception], int] = {
    InvalidRequest: 400,
    UnknownModel: 404,
    BodyTooLarge: 413,
    UnsupportedEncoding: 415,
}


async def _status_error(request: Request, exc: Exception) -> Response:
    # InvalidRequest comes from the body reader: malformed JSON, a body that does not decompress.
    return _error(next(status for kind, status in _STATUS.items() if isinstance(exc, kind)), str(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # Starlette's own: no such route, wrong method
    return _error(exc.status_code, str(exc.detail))


async def _hang_up(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` when the client closes its connection (its body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


def create_engine_app(served: ServedEngine) -> FastAPI:
    """The engine server app; ``served.engine`` is wrapped in a ``BatchingEngine`` (its calls bounded in
    time: ``batcher.MAX_CALL_S``) unless it is one."""
    engine = served.engine
    batcher = engine if isinstance(engine, BatchingEngine) else BatchingEngine(engine, max_call_s=MAX_CALL_S)
    max_model_len = batcher.max_tokens
    started = int(time.time())
    pool: ThreadPoolExecutor | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal pool
        pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="slotread-read")
        try:
            yield
        finally:
            # The server has answered the requests in flight; let the threads go.
            await asyncio.to_thread(pool.shutdown, True)

    app = FastAPI(title="slotread engine", version="0.1.0", lifespan=lifespan)

    @app.post("/v1/completions", summary="Read label logprobs at a prompt's next token or a canvas's positions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, MAX_BODY_BYTES)
        reads = parse_completions(
            body,
            model=served.name,
            family=batcher.family,
            vocab_size=served.vocab_size,
            max_model_len=max_model_len,
        )
        assert pool is not None, "the lifespan starts the pool before the first request"
        loop = asyncio.get_running_loop()
        gone = threading.Event()
        watcher = asyncio.create_task(_hang_up(request, gone))
        read = functools.partial(batcher.read, [read_request(read) for read in reads], abandoned=gone.is_set)
        try:
            scores = await loop.run_in_executor(pool, read)
        except ReadAbandoned:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watcher.cancel()
        return JSONResponse(completion_response(reads, scores, served.name))

    @app.get("/v1/models", summary="The served model")
    async def models() -> dict[str, Any]:
        model = {
            "id": served.name,
            "object": "model",
            "created": started,
            "owned_by": "slotread",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/healthz", summary="The server is up and its model loaded")
    @app.get("/health", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    handlers: dict[type[Exception], Callable[[Request, Exception], Any]] = {
        WireError: _wire_error,
        **dict.fromkeys(_STATUS, _status_error),
        HTTPException: _http_error,
    }
    for error, handler in handlers.items():
        app.add_exception_handler(error, handler)
    return app
