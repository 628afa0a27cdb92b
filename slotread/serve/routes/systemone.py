"""``POST /v1/systemone``: the System One body goes to the Decider as it is; the answer comes back as it is.

The Decider validates the body (422 detail located under ``body``); a multipart body's image files
go with it (``serve/multipart.py``). This route only reads what the server itself needs first: the
client's ``request_id`` (echoed in ``x-typesafe-request-id``) and the queue ``priority``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from slotread.api.responses import SystemOneResponse
from slotread.api.systemone import SystemOneRequest
from slotread.serve.deps import Authorized, ServiceDep
from slotread.serve.multipart import DecisionBody
from slotread.serve.openapi import json_body, json_responses
from slotread.serve.request_id import is_echoable

EXAMPLE = {
    "state": "My card still hasn't arrived after two weeks. Send a new one!",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Does the customer need this solved within a few days?"},
        # no null description: FastAPI leaves null values out of the document, which would leave one option
        "intent": {
            "type": "choice",
            "criteria": {"card_arrival": "a card they ordered has not arrived", "other": "anything else"},
        },
        "frustration": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
    },
}
BODY, BODY_SCHEMAS = json_body(SystemOneRequest, "SystemOne", EXAMPLE)
RESPONSES, RESPONSE_SCHEMAS = json_responses(SystemOneResponse, "SystemOne")
SCHEMAS = {**BODY_SCHEMAS, **RESPONSE_SCHEMAS}

router = APIRouter(dependencies=[Authorized], tags=["decisions"])


def queue_priority(body: Any) -> int:
    """The body's vLLM ``priority`` if it is an integer (the Decider reports any other value as 422)."""
    priority = body.get("priority") if isinstance(body, dict) else None
    return priority if type(priority) is int else 0


@router.post("/v1/systemone", openapi_extra={**BODY, **RESPONSES}, summary="Answer bounded questions about a state")
async def systemone(request: Request, sent: DecisionBody, service: ServiceDep) -> JSONResponse:
    """Answer every question of a System One request (JSON, or multipart with image files)."""
    body, parts = sent
    if isinstance(body, dict) and is_echoable(body.get("request_id")):
        request.state.request_id = body["request_id"]
    response = await service.decide(body, request.is_disconnected, queue_priority(body), parts)
    return JSONResponse(response)
