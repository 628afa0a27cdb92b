"""The pipeline reads as its docstring says: the numbered stages are the calls a request makes, in that order."""

import ast
import inspect
import re
from collections.abc import Callable
from typing import Any

from slotread import pipeline


def calls(function: Callable[..., Any]) -> list[str]:
    """The names a function calls, in the order they appear in its source."""
    tree = ast.parse(inspect.getsource(function))
    found = [
        (node.lineno, node.col_offset, node.func.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    return [name for _, _, name in sorted(found)]


def test_the_numbered_stages_are_the_calls_a_request_makes_in_order() -> None:
    doc = pipeline.__doc__ or ""
    stages = re.findall(r"^\d+\. ``(\w+)``", doc, flags=re.MULTILINE)
    assert len(stages) == 8
    made = [name for name in calls(pipeline.answer) + calls(pipeline.respond) if name in stages]
    assert made == stages
    assert all(callable(getattr(pipeline, name)) for name in stages)


def test_each_plan_stage_runs_its_steps_in_the_order_the_docstring_gives() -> None:
    doc = pipeline.__doc__ or ""
    chain = doc[doc.index("``ask`` →") : doc.index("8. ")]
    steps = [re.findall(r"``(\w+)``", part)[0] for part in chain.split("→")]
    assert steps == ["ask", "render_units", "read", "aggregate_units", "finish"]
    made = [name for name in calls(pipeline.read_stages) if name in steps]
    assert made == steps
