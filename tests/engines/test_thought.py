"""Thought generation against transformers' own ``generate``: greedy on tiny causal LMs, block diffusion on
the tiny DiffusionGemma (the library's loop under the same seed, drawn from the global generator)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DiffusionGemmaForBlockDiffusion, PreTrainedModel

from slotread.engines.causal import CausalEngine
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.thought import ThoughtRequest
from slotread.models.tiny import GEMMA4_VOCAB_SIZE, tiny_diffusion_gemma
from tests.engines.test_causal import CONFIGS


def _prompt(vocab: int, length: int, seed: int = 3) -> tuple[int, ...]:
    return tuple(torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_thought_is_generate(name: str) -> None:
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(CONFIGS[name], dtype=torch.float32).eval()
    prompt = _prompt(model.config.vocab_size, 21)  # past the gemma3 config's 8-token window
    with torch.inference_mode():
        library = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0
        )[0, len(prompt) :].tolist()
    engine = CausalEngine(model)
    (whole,) = engine.think([ThoughtRequest((prompt[:9], prompt[9:]), 30, frozenset())])
    assert list(whole) == library
    # a stop id ends the thought before it, where generate ends on it
    stop = library[17]
    (cut,) = engine.think([ThoughtRequest((prompt,), 30, frozenset({stop}))])
    assert list(cut) == library[: library.index(stop)]
    (short,) = engine.think([ThoughtRequest((prompt,), 5, frozenset())])
    assert list(short) == library[:5]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_thoughts_are_batched_generate(name: str) -> None:
    """Rows of different lengths, budgets and stops in one call: each as a left-padded ``generate`` gives it."""
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(CONFIGS[name], dtype=torch.float32).eval()
    prompts = [_prompt(model.config.vocab_size, n, seed) for n, seed in ((21, 3), (9, 4), (14, 5))]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        library = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0
        )[:, width:].tolist()
    stop = library[1][6]
    requests = [
        ThoughtRequest((prompts[0],), 20, frozenset()),
        ThoughtRequest((prompts[1],), 20, frozenset({stop})),
        ThoughtRequest((prompts[2],), 11, frozenset()),
    ]
    thoughts = CausalEngine(model).think(requests)
    assert [list(t) for t in thoughts] == [library[0], library[1][: library[1].index(stop)], library[2][:11]]


@pytest.fixture(scope="module")
def diffusion() -> DiffusionGemmaForBlockDiffusion:
    return tiny_diffusion_gemma(seed=0)


def test_diffusion_thought_is_the_library_generation(diffusion: DiffusionGemmaForBlockDiffusion) -> None:
    """Two blocks of the tiny model's 32-token canvas, denoised as ``generate`` denoises them."""
    prompt = _prompt(GEMMA4_VOCAB_SIZE, 19)
    torch.manual_seed(5)
    with torch.inference_mode():
        output = diffusion.generate(torch.tensor([prompt]), max_new_tokens=64, max_denoising_steps=6)
    sequence = output.sequences if hasattr(output, "sequences") else output
    library = sequence[0, len(prompt) :].tolist()
    assert len(library) == 64
    kept = getattr(diffusion.generation_config, "max_denoising_steps", None)
    diffusion.generation_config.max_denoising_steps = 6
    try:
        engine = DiffusionGemmaEngine(diffusion)
        (whole,) = engine.think([ThoughtRequest((prompt,), 64, frozenset(), seed=5)])
        assert list(whole) == library
        stop = library[40]  # in the second block
        (cut,) = engine.think([ThoughtRequest((prompt[:7], prompt[7:]), 64, frozenset({stop}), seed=5)])
        assert list(cut) == library[: library.index(stop)]
        (short,) = engine.think([ThoughtRequest((prompt,), 40, frozenset(), seed=5)])
        assert list(short) == library[:40]
        (other,) = engine.think([ThoughtRequest((prompt,), 40, frozenset(), seed=6)])
        assert list(other) != library[:40]  # the seed draws the noise
    finally:
        diffusion.generation_config.max_denoising_steps = kept


@pytest.fixture(scope="module")
def diffusion_float64() -> DiffusionGemmaForBlockDiffusion:
    """The tiny model in float64 (with the eager experts loop: grouped_mm takes no float64). A padded batch
    rounds a row differently from the row alone; in float32 that moved a sampled token on an AVX-512
    EPYC even on one thread, in float64 the difference is far below any sampling margin."""
    model = tiny_diffusion_gemma(seed=0, dtype=torch.float64)
    model.set_experts_implementation("eager")
    return model


@pytest.mark.usefixtures("one_torch_thread")
def test_diffusion_thoughts_together_are_each_alone(diffusion_float64: DiffusionGemmaForBlockDiffusion) -> None:
    """Rows of different prompt lengths, budgets, stops and seeds generated in one call (left-padded) write
    what each writes alone: each row keeps its positions, its generator and its own stopping."""
    diffusion = diffusion_float64
    kept = getattr(diffusion.generation_config, "max_denoising_steps", None)
    diffusion.generation_config.max_denoising_steps = 6
    try:
        engine = DiffusionGemmaEngine(diffusion)
        alone_first = engine.think([ThoughtRequest((_prompt(GEMMA4_VOCAB_SIZE, 19),), 64, frozenset(), seed=5)])[0]
        requests = [
            ThoughtRequest((_prompt(GEMMA4_VOCAB_SIZE, 19),), 64, frozenset(), seed=5),
            ThoughtRequest((_prompt(GEMMA4_VOCAB_SIZE, 7, seed=4),), 40, frozenset(), seed=1),
            ThoughtRequest((_prompt(GEMMA4_VOCAB_SIZE, 30, seed=9),), 64, frozenset({alone_first[10]}), seed=2),
            ThoughtRequest((_prompt(GEMMA4_VOCAB_SIZE, 12, seed=8),), 0, frozenset(), seed=3),
        ]
        alone = [engine.think([request])[0] for request in requests]
        together = engine.think(requests)
        assert together == alone
        assert [len(t) for t in alone[:2]] == [64, 40] and alone[3] == ()
        assert len({t[:8] for t in alone[:3]}) == 3  # the rows wrote different thoughts
    finally:
        diffusion.generation_config.max_denoising_steps = kept
