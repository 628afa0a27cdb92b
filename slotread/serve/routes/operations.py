"""Operations: ``/healthz`` (the process answers and its engine runs), ``/readyz`` (the model is
loaded and, on a gateway, an upstream replica is in rotation), ``/metrics``.

None of these needs an API key: load balancers and Prometheus scrape them without one.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotread.serve.deps import ServiceDep

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The server process is up")
async def healthz(service: ServiceDep) -> JSONResponse:
    """``{"status": "ok"}`` while the process serves HTTP; 503 once its engine's own process
    (``--engine-process``) has ended, which only a restart mends."""
    if service.engine_exited:
        return JSONResponse({"status": "engine_exited", "reason": service.unready_reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", summary="The model is loaded and decisions are answered")
async def readyz(service: ServiceDep) -> JSONResponse:
    """200 once the model is loaded; 503 with the reason before (or if loading failed). A gateway lists
    its upstream replicas, each "up" or "down", and is ready while one is up."""
    remote = service.upstreams
    states = {replica.url: "up" if replica.up else "down" for replica in remote.pool.stats()} if remote else {}
    replicas = {"upstreams": states} if remote else {}
    if service.ready:
        return JSONResponse({"status": "ready", "model": service.ready_decider().name, **replicas})
    return JSONResponse({"status": "not_ready", "reason": service.unready_reason, **replicas}, status_code=503)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(service: ServiceDep) -> Response:
    """Requests by route and status, latencies, questions, reads, queue depth."""
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
