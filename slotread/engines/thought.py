"""Thoughts before a read: the engine side of ``x_think``.

An engine that can think generates up to ``max_tokens`` tokens after a prompt that opens the model's
reasoning (``prompt.thinking`` builds it), stopping at the first of ``stop_ids``, which is left out of
the thought. The causal engine generates greedily (``causal_thought``); DiffusionGemma denoises block
after block as the library generates (``diffusion_gemma.thought``), drawing from a generator seeded by
``seed``. The thought is then put in the read's prompt or reply, and every draw of the read follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Protocol, runtime_checkable

#: The largest thought budget a request may ask (the example server's ``think`` cap).
MAX_THOUGHT_TOKENS = 4096


@dataclass(frozen=True)
class ThoughtRequest:
    """One thought to generate: the prompt that opens it (segments, as a read's), its budget, the ids that
    end it, and the seed of a noisy engine's sampler."""

    prompt: tuple[tuple[int, ...], ...]
    max_tokens: int
    stop_ids: frozenset[int]
    seed: int = 0

    @cached_property
    def prompt_ids(self) -> tuple[int, ...]:
        """The whole prompt as one id sequence."""
        return tuple(chain.from_iterable(self.prompt))


@runtime_checkable
class Thinker(Protocol):
    """An engine that writes thoughts: the generated ids of each request, in order, without the stop id."""

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]: ...


def can_think(engine: object) -> bool:
    """Whether ``engine`` writes thoughts: a ``Thinker``, unless it is a wrapper saying its engine does not
    (``thinks = False``, as the server's batching wrapper says of a masked model's engine)."""
    return isinstance(engine, Thinker) and bool(getattr(engine, "thinks", True))
