"""Thinking and multi-step reads through the Decider: SmolLM2 (real weights, greedy thoughts) and the tiny
DiffusionGemma with the real Gemma tokenizer (thought channel, denoise steps)."""

from __future__ import annotations

from typing import Any

import pytest

from slotread import Decider
from slotread.engines.base import ReadRequest, SlotScores
from slotread.engines.thought import ThoughtRequest
from slotread.errors import InvalidRequest, PromptTooLong
from slotread.models.load import LoadedModel

BODY: dict[str, Any] = {
    "state": "My card never arrived and I need to pay rent tomorrow.",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is the customer in a hurry?"},
        "mood": {"type": "score", "instructions": "How upset are they?", "criteria": ["calm", "annoyed", "furious"]},
    },
}


class Recording:
    """The Decider's engine, keeping what it was asked to think and read."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.family, self.noisy, self.max_tokens = engine.family, engine.noisy, engine.max_tokens
        self.deterministic = engine.deterministic
        self.thoughts: list[tuple[ThoughtRequest, tuple[int, ...]]] = []
        self.reads: list[ReadRequest] = []

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        thoughts = self.engine.think(requests)
        self.thoughts += zip(requests, thoughts, strict=True)
        return thoughts

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.reads += requests
        return self.engine.read(requests)


def recording(loaded: LoadedModel) -> tuple[Decider, Recording]:
    decider = Decider(loaded)
    engine = Recording(decider.engine)
    decider.engine = engine  # type: ignore[assignment]
    return decider, engine


@pytest.mark.parametrize("name", ["smollm2", "tiny_diffusion"])
def test_every_draw_reads_after_the_one_thought(name: str, request: pytest.FixtureRequest) -> None:
    loaded: LoadedModel = request.getfixturevalue(name)
    decider, engine = recording(loaded)
    config = loaded.model.generation_config
    kept = getattr(config, "max_denoising_steps", None)
    config.max_denoising_steps = 4  # DiffusionGemma: 4 steps per block, not the library's 48 (CPU time)
    try:
        response = decider.decide({**BODY, "x_think": 12, "x_thought": True, "x_samples": 3})
    finally:
        config.max_denoising_steps = kept
    assert len(engine.thoughts) == 2  # one per question (its branch), in one call
    tokenizer = loaded.tokenizer
    thought_tokens = 0
    for qid, (asked, thought) in zip(BODY["questions"], engine.thoughts, strict=True):
        assert asked.max_tokens == 12 and len(thought) <= 12
        thought_tokens += len(thought)
        answer = response["answers"][qid]
        assert answer["x_thought"] == tokenizer.decode(list(thought), skip_special_tokens=True).strip()
        # every draw of this question reads with the thought in place
        draws = [
            r for r in engine.reads if _holds(r, thought) and r.prompt[: len(asked.prompt) - 1] == asked.prompt[:-1]
        ]
        assert len(draws) == (3 if engine.noisy else 1)
        assert len({(r.prompt, r.canvas) for r in draws}) == 1
    reads = 2 * (3 if engine.noisy else 1)
    assert response["usage"]["output_tokens"] == reads + thought_tokens
    plain = decider.decide({**BODY, "x_samples": 3})
    assert "x_thought" not in plain["answers"]["urgent"]
    assert plain["usage"]["output_tokens"] == reads


def _holds(request: ReadRequest, thought: tuple[int, ...]) -> bool:
    """Whether the read's prompt or canvas holds the thought's ids in a row."""
    ids = [*request.prompt_ids, *request.canvas]
    n = len(thought)
    return n == 0 or any(tuple(ids[i : i + n]) == thought for i in range(len(ids) - n + 1))


def test_diffusion_steps_reach_the_engine_and_move_the_answer(tiny_diffusion: LoadedModel) -> None:
    decider, engine = recording(tiny_diffusion)
    one = decider.decide({**BODY, "x_samples": 2})
    four = decider.decide({**BODY, "steps": 4, "x_samples": 2})
    assert {r.steps for r in engine.reads} == {1, 4}
    assert four == decider.decide({**BODY, "x_steps": 4, "x_samples": 2})  # the same request, the same answer
    assert one["answers"]["urgent"]["noul"] != four["answers"]["urgent"]["noul"]


def test_a_causal_model_refuses_steps_and_a_masked_one_thinking(smollm2: LoadedModel, tiny_bert: LoadedModel) -> None:
    with pytest.raises(InvalidRequest) as caught:
        Decider(smollm2).decide({**BODY, "x_steps": 2})
    assert [d["loc"] for d in caught.value.detail] == [["body", "x_steps"]]
    with pytest.raises(InvalidRequest) as caught:
        Decider(tiny_bert).decide({**BODY, "think": 16})
    assert [d["loc"] for d in caught.value.detail] == [["body", "think"]]


def test_a_thought_that_could_outgrow_the_prompt_limit_is_refused_before_thinking(smollm2: LoadedModel) -> None:
    decider, engine = recording(smollm2)
    decider.max_prompt_tokens = 300
    with pytest.raises(PromptTooLong):
        decider.decide({**BODY, "x_think": 4096})
    assert engine.thoughts == []  # refused before any generation
