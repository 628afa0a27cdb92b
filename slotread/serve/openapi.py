"""Request-body schemas for the OpenAPI document of routes that read their body themselves.

The decision routes decode their body (zstd, gzip, size limits) before any validation, so FastAPI
cannot derive the body schema from a parameter. ``json_body`` builds it from the api module's
pydantic model, with references pointing into ``components/schemas`` where ``add_schemas`` puts them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``openapi_extra`` for a route whose JSON body is ``model``, and the component schemas it refers to."""
    schema = model.model_json_schema(ref_template=_REF)
    components = schema.pop("$defs", {})
    components[model.__name__] = schema
    extra = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    }
    return extra, components


def add_schemas(document: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``document`` with ``components`` added to its component schemas."""
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return document
