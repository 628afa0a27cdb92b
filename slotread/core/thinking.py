"""``think``: the model writes a thought before each read, and every draw of that read follows it.

Each read unit (a question's branch, or a joint canvas) gets one thought, generated once by the engine
(``engines.thought``) after the unit's prompt opened for thinking (``prompt.thinking``); the unit is
then re-rendered with the thought in place, and its draws, re-reads (``samples: "auto"``) and slots
all read after that one thought. Each option assignment (``x_permutations``) is its own unit and
thinks for itself, since its prompt lists the options under other labels. A DiffusionGemma thought is
sampled: its seed comes from the request seed and the unit's own token ids, as a read's noise does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol
from weakref import WeakKeyDictionary

import numpy as np

from slotread.engines.base import Engine
from slotread.engines.thought import Thinker, ThoughtRequest, can_think
from slotread.errors import PromptTooLong
from slotread.prompt.render import Rendered, Renderer
from slotread.prompt.thinking import ThoughtFormat

_formats: WeakKeyDictionary[Renderer, ThoughtFormat] = WeakKeyDictionary()


class ThinkingUnit(Protocol):
    """A read unit as thinking sees it: its rendered read, replaced by the read after the thought."""

    rendered: Rendered
    thought: str | None
    thought_tokens: int


def thought_format(renderer: Renderer) -> ThoughtFormat:
    """The renderer's thought format, built once per renderer."""
    if renderer not in _formats:
        _formats[renderer] = ThoughtFormat.of(renderer.tokenizer, renderer.family)
    return _formats[renderer]


def think(
    units: Sequence[ThinkingUnit], budget: int, seed: int, engine: Engine, renderer: Renderer, limit: int
) -> None:
    """Give every unit a thought of at most ``budget`` tokens, in one engine call, and its read after it.

    Raises PromptTooLong before generating anything if a read could outgrow ``limit`` tokens with a
    thought of the whole budget (a thought is never cut to fit)."""
    if not can_think(engine):
        raise ValueError(f"the {type(engine).__name__} writes no thoughts")
    assert isinstance(engine, Thinker)
    form = thought_format(renderer)
    for unit in units:
        longest = unit.rendered.tokens + len(form.opener) + budget + len(form.closer)
        if longest > limit:
            raise PromptTooLong(longest, limit)
    prompts = [form.thought_prompt(unit.rendered) for unit in units]
    requests = [ThoughtRequest(prompt, budget, form.stop_ids, _thought_seed(seed, prompt)) for prompt in prompts]
    for unit, thought in zip(units, engine.think(requests), strict=True):
        unit.rendered = form.with_thought(unit.rendered, thought)
        text = renderer.tokenizer.decode(list(thought), skip_special_tokens=True)
        assert isinstance(text, str)
        unit.thought = text.strip()
        unit.thought_tokens = len(thought)


def _thought_seed(request_seed: int, prompt: tuple[tuple[int, ...], ...]) -> int:
    """A sampler seed from the request seed and the thought prompt's ids."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{request_seed}:thought:".encode())
    for segment in prompt:
        digest.update(np.asarray(segment, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
