"""Image reads on a tiny random-weight DiffusionGemma with its vision tower, against transformers' own forward.

The prompt is rendered with the real Gemma-4 tokenizer (``core.images`` marks and splices the image),
the engine reads it, and the library reads the same ids (image placeholders as its ``image_token_id``),
pixels and noised canvas, with the encoder masks its generate loop builds (an image's tokens attend to
each other both ways), in float32.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.core.images import Image, place_images
from slotread.core.questions import Option, Question
from slotread.core.reads import question_text
from slotread.engines.base import ReadRequest, SlotScores
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.models.load import LoadedModel, load_model
from slotread.prompt.render import Renderer


def picture(seed: int, height: int = 48, width: int = 72) -> Image:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    return Image(f"picture {seed}", hashlib.sha256(pixels.tobytes()).digest(), pixels, offset=0)


def library_slots(
    model: DiffusionGemmaForBlockDiffusion, request: ReadRequest, bidirectional: bool
) -> list[np.ndarray]:
    """The library's label logits at the request's slots (its full forward; image handles read as
    ``image_token_id``); ``bidirectional=False`` leaves out the image blocks (plain causal masks)."""
    image_id = model.config.image_token_id
    ids = [token if token >= 0 else image_id for token in request.prompt_ids]
    kinds = torch.tensor([[1 if token == image_id else 0 for token in ids]])
    length = len(ids)
    masks = model.model.encoder.create_masks_for_generate(
        config=model.config,
        inputs_embeds=torch.empty(1, length, 0),
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.arange(length)[None],
        mm_token_type_ids=kinds if bidirectional else None,
    )
    noised = noise_canvas(
        request.canvas, [slot.position for slot in request.slots], request.seed, model.config.text_config.vocab_size
    )
    images = request.images
    with torch.inference_mode():
        logits = model(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.stack([torch.from_numpy(image.pixel_values) for image in images]),
            image_position_ids=torch.stack([torch.from_numpy(image.position_ids) for image in images]),
            attention_mask=masks,
            decoder_input_ids=torch.tensor([noised]),
        ).logits[0]
    return [logits[slot.position][list(slot.label_ids)].numpy() for slot in request.slots]


def worst(result: SlotScores, expected: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(result.logits, expected, strict=True))


@pytest.fixture(scope="module")
def tiny_float(tiny_diffusion_dir: Path) -> LoadedModel:
    """The tiny DiffusionGemma checkpoint with the real Gemma-4 tokenizer, in float32."""
    return load_model(str(tiny_diffusion_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(tiny_float: LoadedModel) -> DiffusionGemmaEngine:
    assert isinstance(tiny_float.model, DiffusionGemmaForBlockDiffusion)
    return DiffusionGemmaEngine(tiny_float.model)


def rendered_read(
    engine: DiffusionGemmaEngine, renderer: Renderer, state: str, images: tuple[Image, ...], seed: int
) -> ReadRequest:
    question = Question("q", "choice", "Which colour is the square?", (Option("red"), Option("green"), Option("blue")))
    assert engine.vision is not None
    placed = place_images(state, images, engine.vision, renderer)
    rendered = placed.splice(renderer.render_branch(question_text(question, renderer), placed.state))
    return rendered.with_seed(seed)


def test_an_image_read_matches_the_library_forward(engine: DiffusionGemmaEngine, tiny_float: LoadedModel) -> None:
    model = tiny_float.model
    assert isinstance(model, DiffusionGemmaForBlockDiffusion)
    renderer = Renderer(tiny_float.tokenizer, "diffusion")
    # one image ahead of the text, one inside it (a second image attends to itself, not to the first)
    images = (picture(1), Image("second", *_second(), offset=9))
    request = rendered_read(engine, renderer, "Look at: and then this.", images, seed=5)
    assert sum(token < 0 for token in request.prompt_ids) == sum(image.tokens for image in request.images)

    result = engine.read([request])[0]

    assert worst(result, library_slots(model, request, bidirectional=True)) < 1e-4
    # the blocks matter: the library's plain causal masks read something else
    assert worst(result, library_slots(model, request, bidirectional=False)) > 1e-3


def _second() -> tuple[bytes, np.ndarray]:
    second = picture(2, height=30, width=30)
    return second.digest, second.pixels


def test_a_second_question_about_the_same_image_does_not_run_the_tower_again(
    engine: DiffusionGemmaEngine, tiny_float: LoadedModel
) -> None:
    renderer = Renderer(tiny_float.tokenizer, "diffusion")
    assert engine.vision is not None
    image = picture(7)
    first = rendered_read(engine, renderer, "What is it?", (image,), seed=1)
    runs = engine.vision.runs
    engine.read([first])
    assert engine.vision.runs == runs + 1
    again = rendered_read(engine, renderer, "What is it, again?", (image,), seed=2)
    assert again.images[0] is first.images[0]  # the processor's output is kept too
    assert engine.read([again])
    assert engine.vision.runs == runs + 1  # the kept features, not the tower

    # another image with the same text reads differently: the prefix cache tells them apart by handle
    other = rendered_read(engine, renderer, "What is it?", (picture(8),), seed=1)
    assert other.prompt_ids != first.prompt_ids
    read_first, read_other = engine.read([first, other])
    assert worst(read_first, list(read_other.logits)) > 1e-4
    assert engine.vision.runs == runs + 2
