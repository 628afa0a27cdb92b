"""Multi-step DiffusionGemma reads against the library's own denoising loop, on the tiny random-weight model.

The reference runs transformers' ``_denoising_step`` (its decoder forward, temperature schedule and
entropy-bound sampler, drawing from the global generator) with vLLM's pinning added around it: pinned
positions put back to their seeded tokens after each step, their self-conditioning zeroed by a hook on
the library's ``self_conditioning`` module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma.denoise import sampler_seed
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.models.tiny import GEMMA4_VOCAB_SIZE, tiny_diffusion_gemma

VOCAB = GEMMA4_VOCAB_SIZE


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    return tiny_diffusion_gemma(seed=0)


def _ids(generator: torch.Generator, length: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, VOCAB, (length,), generator=generator).tolist())


def _requests(steps: int) -> list[ReadRequest]:
    generator = torch.Generator().manual_seed(7)
    shapes = [((9,), 16, (3,)), ((12, 20), 16, (2, 9)), ((30,), 8, (0, 5))]  # one prompt past the 16-token window
    return [
        ReadRequest(
            prompt=tuple(_ids(generator, n) for n in segments),
            canvas=_ids(generator, width),
            slots=tuple(Slot(p, _ids(generator, 3)) for p in positions),
            seed=11 + k,
            steps=steps,
        )
        for k, (segments, width, positions) in enumerate(shapes)
    ]


@contextmanager
def _pinned_conditioning(model: DiffusionGemmaForBlockDiffusion, pinned: torch.Tensor) -> Iterator[None]:
    """Zero the self-conditioning signal at ``pinned`` (C,) positions inside the library's decoder forward."""

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, signal = args
        return embeds, signal.masked_fill(pinned[None, :, None], 0.0)

    handle = model.model.decoder.self_conditioning.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def library_read(model: DiffusionGemmaForBlockDiffusion, request: ReadRequest) -> torch.Tensor:
    """The library's loop, pinned: float32 logits (C, V) of the last of ``request.steps`` steps."""
    assert request.seed is not None
    noised = noise_canvas(request.canvas, [slot.position for slot in request.slots], request.seed, VOCAB)
    seeded = torch.tensor([noised])
    pinned = torch.ones(len(noised), dtype=torch.bool)
    pinned[[slot.position for slot in request.slots]] = False
    prompt = torch.tensor([request.prompt_ids])
    config, _ = model._prepare_generation_config(None, max_denoising_steps=request.steps)
    processors = model._prepare_logits_processor(config)
    sampler = EntropyBoundSampler(config.sampler_config, len(noised), VOCAB, request.steps)

    def forward(decoder_input_ids: torch.Tensor, self_conditioning_logits: torch.Tensor | None, **_: object):
        return model(
            input_ids=prompt, decoder_input_ids=decoder_input_ids, self_conditioning_logits=self_conditioning_logits
        )

    torch.manual_seed(sampler_seed(noised))  # the engine's per-canvas generator, as the global one
    canvas, conditioning = seeded, None
    with torch.inference_mode(), _pinned_conditioning(model, pinned):
        for cur_step in range(request.steps, 1, -1):
            canvas, _, conditioning, _ = model._denoising_step(
                decoder_forward=forward,
                current_canvas=canvas,
                argmax_canvas=canvas,
                input_ids=prompt,
                decoder_position_ids=None,
                self_conditioning_logits=conditioning,
                mask_mapping=None,
                past_key_values=None,
                finished_denoising=torch.zeros(1, dtype=torch.bool),
                cur_step=cur_step,
                sampler=sampler,
                logits_processor=processors,
                diffusion_stopping_criteria=None,
            )
            canvas = torch.where(pinned[None], seeded, canvas)  # vLLM's diffusion_pinned
        return forward(canvas, conditioning).logits[0]


@pytest.mark.parametrize("steps", [2, 4])
def test_k_step_read_matches_the_library_loop(model: DiffusionGemmaForBlockDiffusion, steps: int) -> None:
    requests = _requests(steps)
    results = DiffusionGemmaEngine(model).read(requests)
    worst = 0.0
    for request, result in zip(requests, results, strict=True):
        logits = library_read(model, request)
        for i, slot in enumerate(request.slots):
            expected = logits[slot.position, list(slot.label_ids)].numpy()
            worst = max(worst, float(np.abs(result.logits[i] - expected).max()))
    assert worst < 1e-4


def test_more_steps_move_the_read(model: DiffusionGemmaForBlockDiffusion) -> None:
    """The steps are real work: a 4-step read differs from the one-step read of the same seeded canvas,
    and the one-step read is what ``steps=1`` always gave."""
    engine = DiffusionGemmaEngine(model)
    one, four = engine.read(_requests(1)), engine.read(_requests(4))
    moved = max(
        float(np.abs(a - b).max())
        for x, y in zip(one, four, strict=True)
        for a, b in zip(x.logits, y.logits, strict=True)
    )
    assert moved > 1e-2


def test_a_multi_step_read_does_not_depend_on_the_batch(model: DiffusionGemmaForBlockDiffusion) -> None:
    requests = _requests(3)
    together = DiffusionGemmaEngine(model).read(requests)
    alone = [DiffusionGemmaEngine(model).read([request])[0] for request in requests]
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a.logits, b.logits, strict=True):
            # a k-step read is k forwards, each within 1e-5 of its batch's rounding on the tiny model:
            # they add up (1.3e-5 to 1.7e-5 after 3 steps on an AMD EPYC, with one torch thread or two)
            np.testing.assert_allclose(x, y, atol=5e-5)


def test_steps_out_of_range_are_refused(model: DiffusionGemmaForBlockDiffusion) -> None:
    request = _requests(1)[0]
    for steps in (0, 9):
        with pytest.raises(ValueError, match=r"steps must be 1\.\.8"):
            DiffusionGemmaEngine(model).read(
                [ReadRequest(request.prompt, request.canvas, request.slots, 1, steps=steps)]
            )
