"""Body and response schemas for the OpenAPI document of routes that read their body themselves.

The decision routes decode their body (zstd, gzip, size limits) before any validation and answer with
plain dicts, so FastAPI can derive neither schema from the route. ``json_body`` and ``json_responses``
build them from pydantic models, with references into ``components/schemas``, where ``add_schemas``
puts the definitions. The error bodies are those of ``app.py``'s handlers (DESIGN.md section 5).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Problem(BaseModel):
    """One validation problem: where (``loc`` starts at ``body``), what, and its pydantic type."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationFailed(BaseModel):
    """A 422: every problem found in the request."""

    detail: list[Problem]


class ErrorInfo(BaseModel):
    """What went wrong, as a snake_case type and a message."""

    error_type: str
    message: str


class ErrorBody(BaseModel):
    """Any other error."""

    detail: ErrorInfo


_RETRY_HEADERS = {
    "retry-after": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}},
    "retry-after-ms": {"description": "the same wait in milliseconds", "schema": {"type": "integer"}},
}

#: status → (when, whether it carries retry-after); each answered with an ``ErrorBody``
_ERRORS = {
    "401": ("auth is on and the request has no API key or an unknown one (authentication_error)", False),
    "404": ("the request names a model this server does not serve (not_found_error)", False),
    "413": ("the body, what it decompresses to, or a rendered prompt is over the limit (request_too_large)", False),
    "415": ("a Content-Encoding other than gzip, zstd or identity (unsupported_media_type)", False),
    "502": ("a gateway's upstream replica refused a read or answered it malformed (upstream_error)", False),
    "503": ("the model is still loading (not_ready_error), or no upstream replica could take a read", True),
    "529": ("no decision slot freed up in time (overloaded_error)", True),
}


def _schemas(model: type[BaseModel], namespace: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A reference to ``model``'s schema and the component schemas it needs, named ``{namespace}.{class}``
    (``SystemOne.ChoiceQuestion``: both wire formats have a ``ChoiceQuestion``)."""
    ref = f"#/components/schemas/{namespace}.{{model}}"
    schema = model.model_json_schema(ref_template=ref)
    components = {f"{namespace}.{name}": definition for name, definition in schema.pop("$defs", {}).items()}
    components[f"{namespace}.{model.__name__}"] = schema
    return {"$ref": ref.format(model=model.__name__)}, components


def _json(reference: dict[str, str]) -> dict[str, Any]:
    return {"application/json": {"schema": reference}}


def json_body(model: type[BaseModel], namespace: str, example: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``openapi_extra`` for a route whose JSON body is ``model``, and the component schemas it refers to.

    ``example`` is the body the documentation page offers to "Try it out" with: one generated from the schema
    would be refused (``x_samples: 0``).
    """
    reference, components = _schemas(model, namespace)
    content = {"application/json": {"schema": reference, "example": example}}
    return {"requestBody": {"required": True, "content": content}}, components


def json_responses(model: type[BaseModel], namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``openapi_extra`` for a route answering ``model`` (200) or one of the server's error bodies, and
    the component schemas they refer to."""
    answer, components = _schemas(model, namespace)
    failed, failed_components = _schemas(ValidationFailed, "Error")
    error, error_components = _schemas(ErrorBody, "Error")
    responses: dict[str, Any] = {
        "200": {"description": "the answers", "content": _json(answer)},
        "422": {"description": "the request is malformed: every problem, located", "content": _json(failed)},
        "500": {
            "description": "a bug (logged): plain text, or the error body with error_type engine_error when the "
            "model's scores were unusable",
            "content": {"text/plain": {"schema": {"type": "string"}}, **_json(error)},
        },
    }
    for status, (when, retry) in _ERRORS.items():
        responses[status] = {
            "description": when,
            "content": _json(error),
            **({"headers": _RETRY_HEADERS} if retry else {}),
        }
    return {"responses": responses}, {**components, **failed_components, **error_components}


def add_schemas(document: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``document`` with ``components`` added to its component schemas."""
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return document
