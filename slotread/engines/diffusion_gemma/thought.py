"""DiffusionGemma thoughts: the model writes its thought channel by block diffusion, as it generates.

This is transformers 5.17's ``DiffusionGemmaGenerationMixin.generate`` for one prompt, with the
randomness drawn from a generator of its own (tests compare the two under the same seed):

1. the prompt (then each finished block) is encoded into a ``DynamicCache``;
2. a block of ``canvas_length`` uniform random ids is denoised for up to ``max_denoising_steps``
   steps: the decoder with the previous step's processed logits as self-conditioning, the linear
   temperature schedule, the entropy-bound sampler (``denoise._sampled``), until the library's
   stable-and-confident criterion stops it; the block's argmax canvas is appended;
3. blocks follow until a stop id appears (the thought ends before it) or the budget is spent (the
   thought is cut to it).

It runs the library's own forwards over full-vocabulary logits at every canvas position, which
sampling needs; a thought of N tokens costs up to ``ceil(N / canvas_length) * max_denoising_steps``
decoder steps.
"""

from __future__ import annotations

import math

import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    StableAndConfidentStoppingCriteria,
)

from slotread.engines.diffusion_gemma.denoise import Schedule, sampled


def diffusion_thought(
    model: DiffusionGemmaForBlockDiffusion,
    schedule: Schedule,
    prompt: tuple[int, ...],
    max_tokens: int,
    stop_ids: frozenset[int],
    seed: int,
) -> tuple[int, ...]:
    """The thought the model writes after ``prompt``: at most ``max_tokens`` ids, ending before a stop id."""
    device = model.device
    config = model.generation_config
    defaults = DiffusionGemmaGenerationConfig._get_default_generation_params()
    steps = int(getattr(config, "max_denoising_steps", None) or defaults["max_denoising_steps"])
    stability = getattr(config, "stability_threshold", None)
    confidence = getattr(config, "confidence_threshold", None)
    stopping = StableAndConfidentStoppingCriteria(
        defaults["stability_threshold"] if stability is None else stability,
        defaults["confidence_threshold"] if confidence is None else confidence,
    )
    width = int(model.config.canvas_length or 0)
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    fed = torch.tensor([prompt], device=device)
    start = 0
    thought: list[int] = []
    with torch.inference_mode():
        for _ in range(math.ceil(max_tokens / width)):
            positions = torch.arange(start, start + fed.shape[1], dtype=torch.int32, device=device)[None, :]
            cache = model.model.encoder(input_ids=fed, past_key_values=cache, position_ids=positions).past_key_values
            start += fed.shape[1]
            block = _denoised_block(model, schedule, cache, start, width, vocab, steps, stopping, generator)
            for token in block.tolist():
                if token in stop_ids or len(thought) == max_tokens:
                    return tuple(thought)
                thought.append(token)
            fed = block[None, :]
    return tuple(thought)


def _denoised_block(
    model: DiffusionGemmaForBlockDiffusion,
    schedule: Schedule,
    cache: DynamicCache,
    start: int,
    width: int,
    vocab: int,
    steps: int,
    stopping: StableAndConfidentStoppingCriteria,
    generator: torch.Generator,
) -> torch.Tensor:
    """One block's argmax canvas (W,) after denoising from uniform noise (the module docstring's step 2)."""
    device = model.device
    positions = torch.arange(start, start + width, dtype=torch.int32, device=device)[None, :]
    canvas = torch.randint(0, vocab, (1, width), generator=generator, device=device)
    argmax = canvas[0]
    conditioning = None
    stopping.reset()
    embeddings = model.model.decoder.embed_tokens.weight.dtype
    for cur_step in range(steps, 0, -1):
        logits = model(
            decoder_input_ids=canvas,
            past_key_values=cache,
            self_conditioning_logits=conditioning,
            decoder_position_ids=positions,
        ).logits[0]
        processed = logits / schedule.temperature(torch.tensor(cur_step, dtype=torch.int32, device=device), steps)
        argmax = processed.argmax(dim=-1)
        canvas = sampled(processed, schedule.entropy_bound, generator)[None, :]
        conditioning = processed[None].to(embeddings)
        if bool(stopping(argmax[None], processed[None])[0]):
            break
    return argmax
