"""DiffusionGemma's forward in parts (``diffusion_gemma.forward``) against the library's own encoder and
decoder, on a tiny random-weight DiffusionGemma in float32 (two sliding layers of window 16, then a full
one): the KV the encoder writes, segment by segment or at once, and the decoder's hidden states read
through a shared part, with and without a row's own prompt tokens. Each also through the layers'
graph pieces (``layer_graphs.py``; on the CPU they run eagerly over their static buffers, padded to
their token buckets, one object for every forward of a test).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

from slotread.engines.diffusion_gemma.forward import decode, encode
from slotread.engines.diffusion_gemma.inputs import Canvases, NewTokens, OwnPrompt, SharedPart
from slotread.engines.diffusion_gemma.layer_graphs import LayerGraphs
from slotread.models.tiny import tiny_diffusion_gemma

VOCAB = 512
PROMPT, SPLIT, CANVAS = 40, 25, 6  # a prompt past the window, split after its first segment

KV = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    return tiny_diffusion_gemma(vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt (1, PROMPT) and a canvas (1, CANVAS) of random ids."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, PROMPT + CANVAS), generator=generator)
    return ids[:, :PROMPT], ids[:, PROMPT:]


@pytest.fixture(params=["eager", "layer graphs"])
def pieces(request: pytest.FixtureRequest) -> LayerGraphs | None:
    return LayerGraphs(max_tokens=64) if request.param == "layer graphs" else None


def held(model: DiffusionGemmaForBlockDiffusion, kv: KV) -> KV:
    """Per layer, the KV a layer keeps of a prompt: a sliding layer its last ``window - 1`` tokens."""
    config = model.config.get_text_config()
    keep = [config.sliding_window - 1 if kind == "sliding_attention" else None for kind in config.layer_types]
    return [(k[..., -n:, :], v[..., -n:, :]) if n else (k, v) for (k, v), n in zip(kv, keep, strict=True)]


def library_cache(model: DiffusionGemmaForBlockDiffusion, prompt: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config.get_text_config())
    with torch.inference_mode():
        model.model.encoder(input_ids=prompt, past_key_values=cache)
    return cache


def encoded(
    model: DiffusionGemmaForBlockDiffusion,
    tokens: torch.Tensor,
    start: int,
    parent: KV | None,
    pieces: LayerGraphs | None = None,
) -> KV:
    """``forward.encode`` of one row of ``tokens`` at positions from ``start``, continuing ``parent``."""
    config = model.config.get_text_config()
    positions = torch.arange(start, start + tokens.shape[1])[None]
    parents = [] if parent is None else [SharedPart(1, tuple(k for k, _ in parent), tuple(v for _, v in parent))]
    with torch.inference_mode():
        return encode(
            model.model.encoder.language_model,
            config.layer_types,
            config.sliding_window,
            NewTokens(tokens, positions, parents),
            pieces,
        )


def test_encode_writes_the_librarys_kv(model: DiffusionGemmaForBlockDiffusion, tokens, pieces) -> None:
    prompt, _ = tokens
    cache = library_cache(model, prompt)
    whole = held(model, encoded(model, prompt, 0, None, pieces))
    # the second segment continues the first's held KV: its sliding layers see back across the boundary
    first = held(model, encoded(model, prompt[:, :SPLIT], 0, None, pieces))
    rest = encoded(model, prompt[:, SPLIT:], SPLIT, first, pieces)
    joined = held(
        model, [(torch.cat([a, b], -2), torch.cat([c, d], -2)) for (a, c), (b, d) in zip(first, rest, strict=True)]
    )
    for index, (keys, values, _) in enumerate(cache):
        for ours in (whole, joined):
            assert ours[index][0].shape == keys.shape
            assert torch.allclose(ours[index][0], keys, atol=1e-5)
            assert torch.allclose(ours[index][1], values, atol=1e-5)


def test_decode_reads_as_the_librarys_decoder(model: DiffusionGemmaForBlockDiffusion, tokens, pieces) -> None:
    prompt, canvas = tokens
    config = model.config.get_text_config()
    with torch.inference_mode():
        want = model.model.decoder(
            decoder_input_ids=canvas,
            past_key_values=library_cache(model, prompt),
            decoder_position_ids=torch.arange(PROMPT, PROMPT + CANVAS)[None],
        ).last_hidden_state
    kv = held(model, encoded(model, prompt, 0, None, pieces))
    positions = torch.arange(PROMPT, PROMPT + CANVAS)[None]
    bias = torch.zeros(1, CANVAS)
    whole = SharedPart(1, tuple(k for k, _ in kv), tuple(v for _, v in kv))
    # the same prompt as a shared part of its first SPLIT tokens and the row's own tokens after it
    shared = SharedPart(
        1,
        tuple(k[..., : SPLIT - (PROMPT - k.shape[-2]), :] for k, _ in kv),
        tuple(v[..., : SPLIT - (PROMPT - v.shape[-2]), :] for _, v in kv),
    )
    own_width = [min(PROMPT - SPLIT, k.shape[-2]) for k, _ in kv]
    own = OwnPrompt(
        tuple(k[..., -n:, :] for (k, _), n in zip(kv, own_width, strict=True)),
        tuple(v[..., -n:, :] for (_, v), n in zip(kv, own_width, strict=True)),
        tuple(torch.zeros(1, n) for n in own_width),
    )
    with torch.inference_mode():
        canvases = Canvases(canvas, positions, bias, [whole])
        read_whole = decode(model.model.decoder, config.layer_types, canvases, None, layer_graphs=pieces)
        canvases = Canvases(canvas, positions, bias, [shared])
        read_split = decode(model.model.decoder, config.layer_types, canvases, own, layer_graphs=pieces)
    assert torch.allclose(read_whole, want, atol=1e-5)
    assert torch.allclose(read_split, want, atol=1e-5)
