"""``POST /v1/chat/completions`` in schema mode (vLLM's structured-decision example server): the schema
and state messages become a System One body, its answer the assistant message's JSON."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from slotread.api import chat
from slotread.errors import InvalidRequest
from slotread.serve.deps import Authorized, JsonBody, ServiceDep
from slotread.serve.openapi import json_body

#: what the documentation page's "Try it out" sends
EXAMPLE = {
    "messages": [
        {
            "role": "system",
            "content": json.dumps(
                {"questions": [{"id": "urgent", "type": "noul", "instructions": "Does this need an answer today?"}]}
            ),
        },
        {"role": "user", "content": json.dumps({"message": "My card has not arrived and rent is due on Friday."})},
    ]
}
BODY, SCHEMAS = json_body(chat.ChatRequest, "Chat", EXAMPLE)

router = APIRouter(dependencies=[Authorized], tags=["decisions"])


@router.post(
    "/v1/chat/completions",
    openapi_extra=BODY,
    summary="Answer a question schema (system message) about a state (user message)",
)
async def chat_completions(request: Request, body: JsonBody, service: ServiceDep) -> JSONResponse:
    """Schema mode only: exactly two messages, the schema JSON then the state."""
    schema = chat.to_systemone(body)
    try:
        response = await service.decide(schema.body, request.is_disconnected)
    except InvalidRequest as exc:
        raise InvalidRequest(chat.relocate(exc.detail, schema)) from None
    return JSONResponse(chat.from_systemone(response, schema))
