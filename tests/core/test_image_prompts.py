"""Images in a decision's prompts: placed where the state holds them, earlier answers restated after
them, one vision-tower run for every question of the decision, and a marker in the text refused."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.core.images import Image
from slotread.core.questions import Condition, Decision, Option, Question
from slotread.engines.base import ReadRequest, SlotScores
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.errors import InvalidRequest
from slotread.models.load import LoadedModel
from slotread.pipeline import read_stages
from slotread.prompt.render import Renderer


class Recorded:
    """The real engine, keeping every request it was asked to read."""

    def __init__(self, engine: DiffusionGemmaEngine) -> None:
        self.engine, self.vision = engine, engine.vision
        self.family, self.noisy, self.max_tokens = engine.family, engine.noisy, engine.max_tokens
        self.requests: list[ReadRequest] = []

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        self.requests += requests
        return self.engine.read(requests)


def square(colour: tuple[int, int, int]) -> np.ndarray:
    pixels = np.full((32, 32, 3), 250, dtype=np.uint8)
    pixels[8:24, 8:24] = colour
    return pixels


def image(colour: tuple[int, int, int], offset: int) -> Image:
    pixels = square(colour)
    return Image(str(colour), hashlib.sha256(pixels.tobytes()).digest(), pixels, offset)


@pytest.fixture(scope="module")
def engine(tiny_diffusion: LoadedModel) -> DiffusionGemmaEngine:
    assert isinstance(tiny_diffusion.model, DiffusionGemmaForBlockDiffusion)
    return DiffusionGemmaEngine(tiny_diffusion.model)


def test_staged_reads_restate_earlier_answers_after_the_image(
    engine: DiffusionGemmaEngine, tiny_diffusion: LoadedModel
) -> None:
    renderer = Renderer(tiny_diffusion.tokenizer, "diffusion")
    tokenizer = tiny_diffusion.tokenizer
    first = Question("shape", "choice", "Which shape is it?", (Option("square"), Option("circle")))
    second = Question(
        "red",
        "noul",
        "Is it red?",
        (Option("yes"), Option("no")),
        depends_on=("shape",),
        ask_if=(Condition("shape", frozenset({"square", "circle"})),),
    )
    decision = Decision(
        state="Photo: and a caption.", questions=(first, second), images=(image((200, 0, 0), offset=len("Photo:")),)
    )
    recorded = Recorded(engine)
    assert engine.vision is not None
    runs = engine.vision.runs

    result = read_stages(decision, recorded, renderer)

    assert set(result.answers) == {"shape", "red"} and all(result.answers.values())
    assert engine.vision.runs == runs + 1  # both stages, one run of the tower
    later = recorded.requests[-1]
    handle = later.images[0].handle
    assert {r.images[0].handle for r in recorded.requests} == {handle}
    ids = list(later.prompt_ids)
    end = len(ids) - ids[::-1].index(handle)  # just past the image's last soft token
    after = tokenizer.decode(ids[end:])
    before = tokenizer.decode([t for t in ids[:end] if t >= 0])
    assert "Earlier answers" in after and "Earlier answers" not in before
    assert "Photo:" in before and "and a caption." in after
    # the image sits between begin and end tokens, its soft tokens as many as the processor made
    start = ids.index(handle)
    assert ids[start - 1] == engine.vision.preparer.begin and ids[end] == engine.vision.preparer.end
    assert end - start == later.images[0].tokens
    # usage counts the soft tokens as input
    assert result.input_tokens >= 2 * later.images[0].tokens


def test_the_text_of_the_image_token_in_the_state_is_refused(
    engine: DiffusionGemmaEngine, tiny_diffusion: LoadedModel
) -> None:
    renderer = Renderer(tiny_diffusion.tokenizer, "diffusion")
    marker = tiny_diffusion.tokenizer.convert_ids_to_tokens(tiny_diffusion.model.config.boi_token_id)
    question = Question("q", "noul", None, (Option("yes"), Option("no")))
    decision = Decision(state=f"look {marker} here", questions=(question,), images=(image((0, 0, 200), 0),))
    with pytest.raises(InvalidRequest) as caught:
        read_stages(decision, engine, renderer)
    assert caught.value.detail[0]["loc"] == ["body", "state"]
    # without images the same text is read as text
    plain = read_stages(Decision(state=f"look {marker} here", questions=(question,)), engine, renderer)
    assert plain.answers["q"] is not None
