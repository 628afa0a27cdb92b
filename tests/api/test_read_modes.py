"""The read-mode options on the wire: think/x_think, x_thought, steps/x_steps (ranges, names, conflicts)."""

from __future__ import annotations

from typing import Any

import pytest

from slotread.api.read_modes import ReadModes, model_problems
from tests.api.test_systemone import decision, problems

BODY: dict[str, Any] = {"state": "s", "questions": {"q": {"type": "noul"}}}


@pytest.mark.parametrize(
    ("fields", "think", "steps"),
    [
        ({}, 0, 1),
        ({"think": False}, 0, 1),
        ({"think": 0}, 0, 1),
        ({"think": 64}, 64, 1),
        ({"x_think": 4096}, 4096, 1),
        ({"think": 8, "x_think": 8}, 8, 1),
        ({"steps": 4}, 0, 4),
        ({"x_steps": 8, "x_think": 1}, 1, 8),
    ],
)
def test_read_modes_reach_the_decision(fields: dict[str, Any], think: int, steps: int) -> None:
    made = decision({**BODY, **fields})
    assert (made.think, made.steps) == (think, steps)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"think": True}, "think"),
        ({"think": -1}, "think"),
        ({"think": 4097}, "think"),
        ({"x_think": 5000}, "x_think"),
        ({"steps": 0}, "steps"),
        ({"x_steps": 9}, "x_steps"),
        ({"think": 4, "x_think": 8}, "think"),
        ({"steps": 2, "x_steps": 3}, "steps"),
        ({"x_thought": True}, "x_thought"),  # nothing to return without a thought
        ({"x_thought": True, "x_think": 8, "x_permutations": 2}, "x_thought"),
    ],
)
def test_bad_read_modes_are_422s_naming_the_field(fields: dict[str, Any], field: str) -> None:
    detail = problems({**BODY, **fields})
    assert {tuple(d["loc"][:2]) for d in detail} == {("body", field)}
    assert any(field in d["msg"] or d["type"] in ("less_than_equal", "greater_than_equal") for d in detail)


@pytest.mark.parametrize(("fields", "field"), [({"x_think": "64"}, "x_think"), ({"steps": 2.0}, "steps")])
def test_read_modes_take_integers_only(fields: dict[str, Any], field: str) -> None:
    assert {tuple(d["loc"][:2]) for d in problems({**BODY, **fields})} == {("body", field)}


def test_the_served_model_must_support_the_mode() -> None:
    modes = ReadModes(think=64, steps=4, think_field="think", steps_field="x_steps")
    assert model_problems(modes, "m", "diffusion", thinks=True) == []
    causal = model_problems(modes, "qwen", "causal", thinks=True)
    assert [d["loc"] for d in causal] == [["body", "x_steps"]] and "qwen" in causal[0]["msg"]
    masked = model_problems(modes, "bert", "masked", thinks=False)
    assert [d["loc"] for d in masked] == [["body", "x_steps"], ["body", "think"]]


def test_thinking_through_upstream_is_refused_saying_why() -> None:
    (problem,) = model_problems(ReadModes(think=8), "dg", "diffusion", thinks=False, upstream=True)
    assert problem["loc"] == ["body", "x_think"] and "--upstream" in problem["msg"]
