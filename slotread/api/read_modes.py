"""The read-mode request options: ``x_think``/``think``, ``x_thought``, ``x_steps``/``steps``.

``think`` (0-4096) is a thought budget in tokens the model writes before each read; ``x_thought: true``
returns each answer's thought. ``steps`` (1-8) denoises a DiffusionGemma canvas that many steps, its
template pinned, before the read. The plain name is the example server's, the ``x_`` one slotread's;
give either (both only if equal). Out of range, a 422 naming the field. Whether the served model can
think or denoise is ``pipeline.validate``'s to check (``model_problems``): the wire format does not know it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotread.core.questions import MAX_STEPS, MAX_THOUGHT_TOKENS
from slotread.errors import ErrorDetail


@dataclass(frozen=True)
class ReadModes:
    """The validated options: a thought budget, whether to return the thought, denoise steps; and the wire
    field each came from (for errors about the served model)."""

    think: int = 0
    thought: bool = False
    steps: int = 1
    think_field: str = "x_think"
    steps_field: str = "x_steps"


def _problem(loc: str, msg: str, kind: str = "value_error") -> ErrorDetail:
    return {"loc": ["body", loc], "msg": msg, "type": kind}


def _given(request: Any, name: str, problems: list[ErrorDetail]) -> tuple[Any, str]:
    """The value of ``name`` or ``x_<name>`` and the field it came from (both given: they must be equal)."""
    plain, prefixed = getattr(request, name, None), getattr(request, f"x_{name}", None)
    if plain is not None and prefixed is not None and plain != prefixed:
        problems.append(_problem(name, f"{name} and x_{name} are the same option: give one, or both equal"))
    return (plain, name) if plain is not None else (prefixed, f"x_{name}")


def read_modes(request: Any, problems: list[ErrorDetail]) -> ReadModes:
    """The read modes of a System One request (``think``/``x_think``, ``x_thought``, ``steps``/``x_steps``);
    every problem is appended to ``problems``."""
    think, think_field = _given(request, "think", problems)
    if think is False:  # the example server's "off"
        think = 0
    if think is True or (think is not None and not 0 <= think <= MAX_THOUGHT_TOKENS):
        msg = f"{think_field} is a thought budget of 0..{MAX_THOUGHT_TOKENS} tokens, got {think!r}"
        problems.append(_problem(think_field, msg))
        think = 0
    steps, steps_field = _given(request, "steps", problems)
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        problems.append(
            _problem(steps_field, f"{steps_field} is a number of denoise steps, 1..{MAX_STEPS}, got {steps}")
        )
        steps = 1
    thought = bool(getattr(request, "x_thought", None))
    if thought and not think:
        problems.append(_problem("x_thought", f"x_thought returns the model's thought: ask {think_field} 1..4096 too"))
    if thought and (getattr(request, "x_permutations", None) or 1) > 1:
        msg = "x_thought returns one thought per question; each option assignment thinks apart: ask x_permutations 1"
        problems.append(_problem("x_thought", msg))
    return ReadModes(think or 0, thought, steps or 1, think_field, steps_field)


def model_problems(
    modes: ReadModes, model: str, family: str, thinks: bool, upstream: bool = False
) -> list[ErrorDetail]:
    """What the served ``model`` (its engine ``family``, whether its engine ``thinks``, whether it is read
    through ``--upstream``) cannot do of ``modes``."""
    problems = []
    if modes.steps > 1 and family != "diffusion":
        msg = f"{model} reads in one forward ({family} model): {modes.steps_field} > 1 needs a DiffusionGemma model"
        problems.append(_problem(modes.steps_field, msg, "not_supported"))
    if modes.think and not thinks:
        why = "read through --upstream, which does not generate" if upstream else f"a {family} model"
        msg = f"{model} cannot write a thought before its read here ({why}): leave {modes.think_field} at 0"
        problems.append(_problem(modes.think_field, msg, "not_supported"))
    return problems
