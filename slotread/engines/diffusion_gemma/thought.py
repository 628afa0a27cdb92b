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
decoder steps. Thoughts are generated together, left-padded (as the library batches ``generate``),
each row with its own positions, generator and stopping, so a row draws exactly what it would alone;
a row that has stopped denoising is frozen, as the library freezes it. Batching changes float
rounding only (on a GPU in bfloat16 a near-tie may then draw another token).
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    StableAndConfidentStoppingCriteria,
)

from slotread.engines.diffusion_gemma.denoise import Schedule, sampled
from slotread.engines.thought import ThoughtRequest

#: Rows per batch: a step holds a few (rows, canvas, vocabulary) float32 logits, 268 MB per row and
#: copy at the 26B shape's 256-token canvas and 262,144 ids.
MAX_ROWS = 16


def diffusion_thoughts(
    model: DiffusionGemmaForBlockDiffusion, schedule: Schedule, requests: list[ThoughtRequest]
) -> list[tuple[int, ...]]:
    """Each request's thought: at most its ``max_tokens`` ids, ending before one of its stop ids."""
    thoughts: list[tuple[int, ...]] = []
    for first in range(0, len(requests), MAX_ROWS):
        thoughts += _batch(model, schedule, requests[first : first + MAX_ROWS])
    return thoughts


def _batch(
    model: DiffusionGemmaForBlockDiffusion, schedule: Schedule, requests: list[ThoughtRequest]
) -> list[tuple[int, ...]]:
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
    prompts = [r.prompt_ids for r in requests]
    widest = max(map(len, prompts))
    fed = torch.tensor([[0] * (widest - len(p)) + list(p) for p in prompts], device=device)
    seen = torch.tensor([[False] * (widest - len(p)) + [True] * len(p) for p in prompts], device=device)
    padded = not bool(seen.all())
    positions = (seen.cumsum(-1, dtype=torch.int32) - 1).clamp(min=0)
    ends = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)[:, None]
    generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    thoughts: list[list[int]] = [[] for _ in requests]
    writing = [r.max_tokens > 0 for r in requests]
    with torch.inference_mode():
        while any(writing):
            cache = model.model.encoder(
                input_ids=fed, attention_mask=seen if padded else None, past_key_values=cache, position_ids=positions
            ).past_key_values
            canvas_seen = torch.nn.functional.pad(seen, (0, width), value=True) if padded else None
            block = _denoised_block(
                model, schedule, cache, ends, canvas_seen, width, vocab, steps, stopping, generators
            )
            for row, tokens in enumerate(block.tolist()):
                if not writing[row]:  # its thought ended: the row is computed along, its tokens dropped
                    continue
                for token in tokens:
                    if token in requests[row].stop_ids or len(thoughts[row]) == requests[row].max_tokens:
                        writing[row] = False
                        break
                    thoughts[row].append(token)
                writing[row] = writing[row] and len(thoughts[row]) < requests[row].max_tokens
            fed = block
            positions = ends + torch.arange(width, dtype=torch.int32, device=device)
            ends = ends + width
            seen = torch.nn.functional.pad(seen, (0, width), value=True)
    return [tuple(t) for t in thoughts]


def _denoised_block(
    model: DiffusionGemmaForBlockDiffusion,
    schedule: Schedule,
    cache: DynamicCache,
    ends: torch.Tensor,
    seen: torch.Tensor | None,
    width: int,
    vocab: int,
    steps: int,
    stopping: StableAndConfidentStoppingCriteria,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """Each row's argmax canvas (B, W) after denoising from uniform noise (the module docstring's step 2);
    ``ends`` (B, 1) is where each row's canvas starts, ``seen`` the rows' padding mask over cache and canvas."""
    device = model.device
    positions = ends + torch.arange(width, dtype=torch.int32, device=device)
    canvas = torch.cat([torch.randint(0, vocab, (1, width), generator=g, device=device) for g in generators])
    argmax = canvas
    conditioning: torch.Tensor | None = None
    finished = [False] * len(generators)
    stopping.reset()
    embeddings = model.model.decoder.embed_tokens.weight.dtype
    for cur_step in range(steps, 0, -1):
        logits = model(
            decoder_input_ids=canvas,
            past_key_values=cache,
            self_conditioning_logits=conditioning,
            decoder_position_ids=positions,
            decoder_attention_mask=seen,
        ).logits
        processed = logits / schedule.temperature(torch.tensor(cur_step, dtype=torch.int32, device=device), steps)
        live = [row for row, done in enumerate(finished) if not done]
        # a finished row keeps its canvas, argmax and conditioning, and draws nothing more from its generator
        argmax, canvas = argmax.clone(), canvas.clone()
        argmax[live] = processed[live].argmax(dim=-1)
        for row in live:
            canvas[row] = sampled(processed[row], schedule.entropy_bound, generators[row])
        if conditioning is not None:
            done = torch.tensor(finished, device=device)
            processed[done] = conditioning[done].to(processed.dtype)
        conditioning = processed.to(embeddings)
        for row, stop in enumerate(stopping(cast(torch.LongTensor, argmax), processed).tolist()):
            finished[row] = finished[row] or stop
        if all(finished):
            break
    return argmax
