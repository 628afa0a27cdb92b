"""Hypothesis strategies from the JSON Schemas of the served OpenAPI document.

Covers what pydantic emits for our request bodies: ``$ref`` into ``components/schemas``,
``anyOf``/``oneOf``, ``const``/``enum``, the scalar types, arrays and objects (``properties``,
``required``, ``additionalProperties``). Sizes are capped so generated prompts stay small.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_MAX_ITEMS = 5
_MAX_TEXT = 30

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=_MAX_TEXT)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=_MAX_ITEMS) | st.dictionaries(st.text(max_size=10), children, max_size=_MAX_ITEMS)
    ),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy ``schema`` (within the caps), resolving references in ``components``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return st.one_of([from_schema(option, components) for option in schema[combinator]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, components) for k in kind])
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", _MAX_TEXT), _MAX_TEXT)))
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", _MAX_ITEMS), _MAX_ITEMS))
        return st.lists(from_schema(schema.get("items", {}), components), min_size=low, max_size=high)
    if kind == "object":
        return _object(schema, components)
    return JSON_VALUES


def _object(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    fixed = st.fixed_dictionaries(
        {name: from_schema(properties[name], components) for name in properties if name in required},
        optional={name: from_schema(properties[name], components) for name in properties if name not in required},
    )
    extra = schema.get("additionalProperties")
    if not isinstance(extra, dict):
        return fixed
    low = schema.get("minProperties", 0)
    more = st.dictionaries(
        st.text(max_size=12), from_schema(extra, components), min_size=low, max_size=max(low, _MAX_ITEMS)
    )
    return st.builds(lambda a, b: {**b, **a}, fixed, more)
