"""Multi-step DiffusionGemma reads: denoise a seeded canvas k steps with its template pinned, then read.

A one-step read (``ReadRequest.steps == 1``) reads the slots of the noised canvas straight away. With
k > 1 steps the canvas is first denoised k - 1 times by the library's own sampler (transformers 5.17,
``DiffusionGemmaGenerationMixin._denoising_step``), with vLLM's ``diffusion_pinned`` semantics on top:

1. step n of k (``cur_step = k - n + 1``, counting down as the library does) runs the decoder over the
   canvas, with the previous step's processed logits as self-conditioning (none on the first step);
2. the logits are divided by the linear temperature schedule ``t_min + (t_max - t_min) * cur_step / k``
   (``LinearTemperatureScheduleLogitsProcessor``); a token is sampled at every position, and the
   entropy-bound sampler accepts the lowest-entropy positions whose summed entropy (less the largest)
   stays within ``entropy_bound`` and renoises the others with uniform random ids
   (``EntropyBoundSampler``);
3. every pinned position (by default every canvas position but the slots: the template, ``<turn|>``,
   padding; ``ReadRequest.pinned`` names them otherwise) is put back to its seeded token, and its
   self-conditioning signal is zeroed for the next step, so the template reads as on the first step and
   only the slots move;
4. the last step's temperature-1 logits at the slots are the read (vLLM's ``diffusion_read_only``).

The sampler draws from a generator seeded by the noised canvas itself (``sampler_seed``), one per
canvas, over the canvas's own width: a read's draws do not depend on the rest of the batch, and a
remote engine handed the same seed canvas draws the same. Sampling turns float rounding into rare
discrete differences: batch composition can flip a draw where two tokens' cumulative probabilities
straddle the uniform draw, so a multi-step read is batch-independent only up to such flips (exactly so
with ``deterministic=True``). Schedule values come from the model's generation config, else the
library's defaults (t 0.4-0.8, entropy bound 0.1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaTextScaledWordEmbedding,
)

from slotread.engines.base import ReadRequest
from slotread.engines.diffusion_gemma.forward import decode
from slotread.engines.diffusion_gemma.inputs import Canvases, OwnPrompt
from slotread.engines.scores import OutputHead

#: The most denoise steps a read may take (the example server's and the API's cap).
MAX_STEPS = 8


@dataclass(frozen=True)
class Schedule:
    """The library's sampler settings: the temperature schedule's ends and the entropy bound."""

    t_min: float
    t_max: float
    entropy_bound: float

    @classmethod
    def of(cls, model: DiffusionGemmaForBlockDiffusion) -> Schedule:
        """The model's generation config where it sets them, else the library's defaults."""
        defaults = DiffusionGemmaGenerationConfig._get_default_generation_params()
        config = model.generation_config

        def value(name: str) -> float:
            given = getattr(config, name, None)
            return float(given if given is not None else defaults[name])

        sampler = getattr(config, "sampler_config", None) or defaults["sampler_config"]
        bound = sampler["entropy_bound"] if isinstance(sampler, dict) else sampler.entropy_bound
        return cls(value("t_min"), value("t_max"), float(bound))

    def temperature(self, cur_step: torch.Tensor, steps: int) -> torch.Tensor:
        """The temperature at ``cur_step`` (steps remaining, k down to 1) of ``steps``, computed as the
        library computes it (a float32 tensor from an int32 step), so the logits it divides round alike."""
        return self.t_min + ((self.t_max - self.t_min) * (cur_step / steps))


def sampler_seed(noised: tuple[int, ...]) -> int:
    """The seed of a canvas's sampler: a hash of its noised tokens (the noise already carries the read's seed)."""
    digest = hashlib.blake2b(np.asarray(noised, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def pinned_mask(requests: list[ReadRequest], columns: int, device: torch.device) -> torch.Tensor:
    """(B, C) bool: True where a canvas holds its token: its ``pinned`` positions (by default everything but
    its slots), and the batch's padding."""
    pinned = torch.ones(len(requests), columns, dtype=torch.bool)
    for row, request in enumerate(requests):
        if request.pinned is None:
            pinned[row, [slot.position for slot in request.slots]] = False
        else:
            pinned[row, : len(request.canvas)] = False
            pinned[row, list(request.pinned)] = True
    return pinned.to(device)


def denoised_hidden(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    head: OutputHead,
    schedule: Schedule,
    requests: list[ReadRequest],
    canvases: Canvases,
    own: OwnPrompt | None,
    steps: int,
) -> torch.Tensor:
    """The decoder's final hidden states (B, C, H) after ``steps`` denoise steps of ``canvases`` (the noised
    canvases of ``requests``, right-padded), each row also reading its ``own`` prompt tokens (the module
    docstring's recipe)."""
    device = canvases.tokens.device
    pinned = pinned_mask(requests, canvases.tokens.shape[1], device)
    seeded = canvases.tokens
    generators = [
        torch.Generator(device=device).manual_seed(sampler_seed(tuple(seeded[row, : len(request.canvas)].tolist())))
        for row, request in enumerate(requests)
    ]
    embed = decoder.embed_tokens
    assert isinstance(embed, DiffusionGemmaTextScaledWordEmbedding)
    conditioning = None
    for cur_step in range(steps, 0, -1):
        hidden = decode(decoder, layer_types, canvases, own, conditioning)
        if cur_step == 1:
            return hidden
        batch, columns, size = hidden.shape
        logits = head.vocabulary(hidden.reshape(batch * columns, size)).view(batch, columns, -1)
        processed = logits / schedule.temperature(torch.tensor(cur_step, dtype=torch.int32, device=device), steps)
        tokens = seeded.clone()
        for row, (request, generator) in enumerate(zip(requests, generators, strict=True)):
            width = len(request.canvas)
            drawn = sampled(processed[row, :width], schedule.entropy_bound, generator)
            tokens[row, :width] = torch.where(pinned[row, :width], seeded[row, :width], drawn)
        canvases = replace(canvases, tokens=tokens)
        # the library conditions on the processed logits in the embeddings' dtype
        soft = processed.to(embed.weight.dtype).softmax(dim=-1, dtype=torch.float32).to(embed.weight.dtype)
        conditioning = (soft @ embed.weight) * embed.embed_scale.to(embed.weight.dtype)
        conditioning = conditioning.masked_fill(pinned[..., None], 0.0)
    raise ValueError(f"steps must be at least 1, got {steps}")


def sampled(processed: torch.Tensor, entropy_bound: float, generator: torch.Generator) -> torch.Tensor:
    """One canvas's next tokens (W,) from its processed logits (W, V): a sampled token where the
    entropy bound accepts it, a uniform random id elsewhere (``EntropyBoundSampler``'s accept and renoise,
    in its order of draws)."""
    vocab = processed.shape[-1]
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    drawn = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    entropy = torch.distributions.Categorical(logits=processed).entropy()
    ordered, order = torch.sort(entropy, descending=False)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= entropy_bound
    accepted = torch.zeros_like(chosen).scatter(-1, order, chosen)
    noise = torch.randint(0, vocab, (1, processed.shape[0]), generator=generator, device=processed.device)[0]
    return torch.where(accepted, drawn, noise)
