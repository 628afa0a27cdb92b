"""``POST /v1/decisions``: OpenAI Decisions requests, answered by the Decider through System One."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from slotread.api import decisions
from slotread.api.responses import DecisionsResponse
from slotread.serve.deps import Authorized, ServiceDep
from slotread.serve.multipart import DecisionBody
from slotread.serve.openapi import json_body, json_responses

EXAMPLE = {
    "input": "My card still hasn't arrived after two weeks. Send a new one!",
    "questions": [
        {"type": "predicate", "name": "urgent", "instructions": "The customer needs this solved within a few days."},
        {"type": "choice", "name": "intent", "choices": [{"value": "card_arrival"}, {"value": "other"}]},
    ],
}
BODY, BODY_SCHEMAS = json_body(decisions.DecisionsRequest, "Decisions", EXAMPLE)
RESPONSES, RESPONSE_SCHEMAS = json_responses(DecisionsResponse, "Decisions")
SCHEMAS = {**BODY_SCHEMAS, **RESPONSE_SCHEMAS}

router = APIRouter(dependencies=[Authorized], tags=["decisions"])


@router.post(
    "/v1/decisions", openapi_extra={**BODY, **RESPONSES}, summary="Answer a list of typed questions about an input"
)
async def create_decision(request: Request, sent: DecisionBody, service: ServiceDep) -> JSONResponse:
    """Answer every question of an OpenAI Decisions request, in question order."""
    wire = decisions.parse_request(sent[0])
    response = await service.decide(decisions.to_systemone(wire), request.is_disconnected)
    return JSONResponse(decisions.from_systemone(response, wire))
