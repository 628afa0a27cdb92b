"""Unknown fields inside a question, refused with the closest known name.

A mistyped field inside a question (``instruction`` for ``instructions``) would otherwise be dropped and the
question answered on a different prompt than the caller meant. Unknown top-level fields stay ignored (System
One's contract says so), and ``x_``-prefixed fields are allowed anywhere, for extensions.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

from slotread.errors import ErrorDetail


def unknown_fields(value: Any, known: Collection[str], loc: list[str | int]) -> list[ErrorDetail]:
    """One problem per field of the object ``value`` (found at ``loc``) that is neither in ``known`` nor
    ``x_``-prefixed; a value that is not an object is left to the schema."""
    if not isinstance(value, dict):
        return []
    problems: list[ErrorDetail] = []
    for field in value:
        if field in known or field.startswith("x_"):
            continue
        closest = difflib.get_close_matches(field, sorted(known), n=1)
        hint = f"did you mean {closest[0]!r}?" if closest else f"known fields: {', '.join(sorted(known))}"
        problems.append({"loc": [*loc, field], "msg": f"unknown field {field!r}; {hint}", "type": "extra_forbidden"})
    return problems
