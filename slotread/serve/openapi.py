"""Request-body schemas for the OpenAPI document of routes that read their body themselves.

The decision routes decode their body (zstd, gzip, size limits) before any validation, so FastAPI
cannot derive the body schema from a parameter. ``json_body`` builds it from the api module's
pydantic model, with references into ``components/schemas``, where ``add_schemas`` puts the definitions.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def json_body(model: type[BaseModel], namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``openapi_extra`` for a route whose JSON body is ``model``, and the component schemas it refers to.

    Component names are prefixed with ``namespace`` (``SystemOne.ChoiceQuestion``): both wire formats
    have a ``ChoiceQuestion``.
    """
    ref = f"#/components/schemas/{namespace}.{{model}}"
    schema = model.model_json_schema(ref_template=ref)
    components = {f"{namespace}.{name}": definition for name, definition in schema.pop("$defs", {}).items()}
    components[f"{namespace}.{model.__name__}"] = schema
    extra = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": ref.format(model=model.__name__)}}},
        }
    }
    return extra, components


def add_schemas(document: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``document`` with ``components`` added to its component schemas."""
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return document
