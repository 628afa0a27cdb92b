"""The DiffusionGemma engine against the library's own forward, on a tiny random-weight DiffusionGemma.

The engine knows token ids only, so random ids stand in for prompts, canvases and labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma.engine import SHARED_MIN, DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.fast_paths import FastPaths
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.engines.prefix_cache import PrefixCache
from slotread.errors import PromptTooLong
from slotread.models.tiny import GEMMA4_VOCAB_SIZE, tiny_diffusion_gemma

VOCAB = GEMMA4_VOCAB_SIZE
WINDOW = 16  # the tiny model's sliding window: prompts of 40 tokens go well past it
Draw = Callable[[int], tuple[int, ...]]


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    model = tiny_diffusion_gemma(seed=0)
    assert model.config.text_config.sliding_window == WINDOW
    return model


@pytest.fixture
def ids() -> Draw:
    """Draws random token ids of a given length, the same ones in every test."""
    generator = torch.Generator().manual_seed(1)
    return lambda length: tuple(torch.randint(3, VOCAB, (length,), generator=generator).tolist())


def make_request(
    ids: Draw, segments: tuple[int, ...], canvas: int, positions: tuple[int, ...], seed: int = 0
) -> ReadRequest:
    """A request with prompt segments of the given lengths and 3 random labels per slot."""
    return ReadRequest(
        prompt=tuple(ids(length) for length in segments),
        canvas=ids(canvas),
        slots=tuple(Slot(position, ids(3)) for position in positions),
        seed=seed,
    )


def library_logits(model: DiffusionGemmaForBlockDiffusion, request: ReadRequest) -> torch.Tensor:
    """The library's full forward on the request's noised canvas: float32 logits (C, V)."""
    noised = noise_canvas(request.canvas, [slot.position for slot in request.slots], request.seed, VOCAB)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([request.prompt_ids]), decoder_input_ids=torch.tensor([noised])).logits[0]


def max_difference(a: SlotScores, b: SlotScores) -> float:
    """The largest label-logit difference between two reads of the same request."""
    assert [x.shape for x in a.logits] == [y.shape for y in b.logits]
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits, strict=True))


class Calls:
    """Counts the calls of one of the engine module's forwards (``encode``, ``encode_decode``) from now on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        import slotread.engines.diffusion_gemma.engine as engine_module

        self.count = 0
        real = getattr(engine_module, name)

        def counted(*args: object, **kwargs: object) -> object:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_module, name, counted)


def test_tiny_model_keeps_the_real_layer_mix(model: DiffusionGemmaForBlockDiffusion) -> None:
    config = model.config.text_config
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    assert config.layer_types[-1] == "full_attention"
    head_dims = {config.per_layer_config[i].head_dim for i in range(config.num_hidden_layers)}
    assert len(head_dims) == 2  # full layers have their own head size
    assert config.num_experts > config.top_k_experts > 1
    assert config.final_logit_softcapping == 30.0
    assert model.lm_head.weight.shape == (VOCAB, config.hidden_size)


# shared_min=1 splits every multi-segment prompt after its first segment: the rest is read per row
@pytest.mark.parametrize("shared_min", [SHARED_MIN, 1])
def test_slot_logits_match_the_library_forward(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, shared_min: int
) -> None:
    requests = [
        make_request(ids, (5,), canvas=6, positions=(0, 3, 5), seed=1),
        make_request(ids, (12, 20, 8), canvas=9, positions=(2, 8), seed=2),  # 40 tokens: past the window
        make_request(ids, (23,), canvas=4, positions=(1,), seed=3),
        make_request(ids, (30, 6), canvas=4, positions=(2,), seed=4),  # the window starts inside segment 1
    ]
    # Let the first slot's labels include the library's argmax, so argmax_is_label is checked both ways.
    first = requests[0]
    top = int(library_logits(model, first)[0].argmax())
    slots = (Slot(0, (ids(1)[0], top)), *first.slots[1:])
    requests[0] = ReadRequest(first.prompt, first.canvas, slots, first.seed)

    results = DiffusionGemmaEngine(model, shared_min=shared_min).read(requests)

    worst_logit, worst_mass = 0.0, 0.0
    for request, result in zip(requests, results, strict=True):
        full = library_logits(model, request)  # (C, V)
        for i, slot in enumerate(request.slots):
            row = full[slot.position]
            expected = row[list(slot.label_ids)].numpy()
            assert result.logits[i].dtype == np.float32
            worst_logit = max(worst_logit, float(np.abs(result.logits[i] - expected).max()))
            mass = float(torch.softmax(row.double(), dim=-1)[list(slot.label_ids)].sum())
            assert 0.0 <= result.label_mass[i] <= 1.0
            worst_mass = max(worst_mass, abs(result.label_mass[i] - mass) / mass)
            assert result.argmax_is_label[i] == (int(row.argmax()) in slot.label_ids)
    assert results[0].argmax_is_label == (True, False, False)
    print(f"max |engine - library| label logit {worst_logit:.3g}, relative label mass {worst_mass:.3g}")
    assert worst_logit <= 1e-4
    assert worst_mass <= 1e-4


@pytest.mark.parametrize(("max_canvases", "shared_min"), [(64, SHARED_MIN), (3, SHARED_MIN), (64, 1)])
def test_a_read_is_the_same_alone_and_in_a_padded_batch(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, max_canvases: int, shared_min: int
) -> None:
    long = make_request(ids, (30, 10), canvas=7, positions=(0, 6), seed=5)  # 40 > WINDOW prompt tokens
    short = make_request(ids, (3,), canvas=2, positions=(1,), seed=6)
    others = [
        make_request(ids, (12,), canvas=10, positions=(4,), seed=7),
        make_request(ids, (17, 9), canvas=3, positions=(0, 1, 2), seed=8),
        make_request(ids, (6,), canvas=5, positions=(2,), seed=9),
        # its second segment is as long as `long`'s: encoded in one batch after parents of other lengths
        make_request(ids, (12, 10), canvas=4, positions=(3,), seed=10),
    ]
    batch = [others[0], long, others[1], short, others[2], others[3]]
    in_batch = DiffusionGemmaEngine(model, max_canvases=max_canvases, shared_min=shared_min).read(batch)
    for request, result in zip(batch, in_batch, strict=True):
        alone = DiffusionGemmaEngine(model).read([request])[0]
        difference = max_difference(alone, result)
        print(f"prompt {len(request.prompt_ids)}, canvas {len(request.canvas)}: max difference {difference:.3g}")
        assert difference <= 1e-5
        np.testing.assert_allclose(alone.label_mass, result.label_mass, rtol=1e-5)
        assert alone.argmax_is_label == result.argmax_is_label


def test_the_seed_fixes_the_noise(model: DiffusionGemmaForBlockDiffusion, ids: Draw) -> None:
    request = make_request(ids, (9,), canvas=6, positions=(1, 4), seed=7)
    reseeded = ReadRequest(request.prompt, request.canvas, request.slots, seed=8)

    noised = noise_canvas(request.canvas, [1, 4], 7, VOCAB)
    assert noised == noise_canvas(request.canvas, [1, 4], 7, VOCAB)
    assert [noised[p] for p in (0, 2, 3, 5)] == [request.canvas[p] for p in (0, 2, 3, 5)]
    assert noised[1] != request.canvas[1] and noised[4] != request.canvas[4]
    other = noise_canvas(request.canvas, [1, 4], 8, VOCAB)
    assert noised[1] != other[1] and noised[4] != other[4]
    # A slot's noise depends on its seed and position only, not on the other slots.
    assert noise_canvas(request.canvas, [4], 7, VOCAB)[4] == noised[4]

    first = DiffusionGemmaEngine(model).read([request])[0]
    again = DiffusionGemmaEngine(model).read([request])[0]
    assert max_difference(first, again) == 0.0
    changed = DiffusionGemmaEngine(model).read([reseeded])[0]
    assert max_difference(first, changed) > 1e-3


def test_one_prompt_shared_by_several_canvases_equals_separate_encodings(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw
) -> None:
    prompt = (ids(25),)
    shared = [
        ReadRequest(prompt, ids(canvas), (Slot(canvas - 1, ids(4)),), seed=seed)
        for seed, canvas in enumerate((4, 4, 7, 2))
    ]
    engine = DiffusionGemmaEngine(model)
    together = engine.read(shared)  # one forward over one prompt: the KV is an expand view
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.misses == 1

    stranger = make_request(ids, (40,), canvas=3, positions=(0,), seed=9)
    mixed = DiffusionGemmaEngine(model).read([*shared, stranger])[: len(shared)]  # padded copies of the KV
    for request, one, two in zip(shared, together, mixed, strict=True):
        alone = DiffusionGemmaEngine(model).read([request])[0]  # its own encoding of the prompt
        assert max_difference(alone, one) <= 1e-5
        assert max_difference(alone, two) <= 1e-5


def test_the_prefix_cache_is_hit_on_a_second_read(model: DiffusionGemmaForBlockDiffusion, ids: Draw) -> None:
    cache = PrefixCache(max_bytes=2**30)
    engine = DiffusionGemmaEngine(model, prefix_cache=cache)
    request = make_request(ids, (20, 7), canvas=5, positions=(2,), seed=3)

    first = engine.read([request])[0]  # the last segment is encoded with the canvas (joint encode)
    assert cache.hits == 0 and len(cache) == 2  # the state boundary and the whole prompt
    misses = cache.misses
    second = engine.read([request])[0]  # the whole prompt from the cache
    assert (cache.hits, cache.misses) == (1, misses)
    assert max_difference(first, second) <= 1e-5  # two forwards' rounding, see the engine docstring
    assert max_difference(second, engine.read([request])[0]) == 0.0  # cached reads are exact
    assert cache.hits == 2

    # A new question after the same first segment resumes from that segment's KV.
    extended = ReadRequest((request.prompt[0], ids(11)), request.canvas, request.slots, request.seed)
    resumed = engine.read([extended])[0]
    assert cache.hits == 3
    assert max_difference(resumed, DiffusionGemmaEngine(model).read([extended])[0]) <= 1e-5


def test_bfloat16_reads_return_float32_close_to_the_library(ids: Draw) -> None:
    model = tiny_diffusion_gemma(seed=0, dtype=torch.bfloat16)
    request = make_request(ids, (30,), canvas=5, positions=(0, 4), seed=2)
    result = DiffusionGemmaEngine(model).read([request])[0]
    full = library_logits(model, request)
    for i, slot in enumerate(request.slots):
        assert result.logits[i].dtype == np.float32
        # lm_head over the slot rows only rounds differently in bfloat16: about one ulp at |logit| ~ 4
        np.testing.assert_allclose(result.logits[i], full[slot.position, list(slot.label_ids)], atol=0.1)


def test_bad_requests_are_refused(model: DiffusionGemmaForBlockDiffusion, ids: Draw) -> None:
    engine = DiffusionGemmaEngine(model, max_tokens=32)
    with pytest.raises(PromptTooLong):
        engine.read([make_request(ids, (30,), canvas=3, positions=(0,))])
    bad = [
        ReadRequest((ids(4),), ids(3), (Slot(3, ids(2)),)),  # slot past the canvas
        ReadRequest((ids(4),), ids(3), (Slot(0, ()),)),  # no labels
        ReadRequest((ids(4),), ids(3), (Slot(0, (VOCAB,)),)),  # label outside the vocabulary
        ReadRequest((ids(4),), ids(3), ()),  # no slots
        ReadRequest(((),), ids(3), (Slot(0, ids(2)),)),  # empty prompt
    ]
    for request in bad:
        with pytest.raises(ValueError):
            engine.read([request])


def test_deterministic_mode_reads_the_same_bits_alone_in_a_batch_and_from_the_cache(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw
) -> None:
    engine = DiffusionGemmaEngine(model, deterministic=True)
    schema = ids(30)
    mine = ReadRequest((schema, ids(10)), ids(6), (Slot(2, ids(3)),), seed=4)
    others = [ReadRequest((schema, ids(n)), ids(9), (Slot(1, ids(3)),), seed=n) for n in (10, 7, 12)]
    alone = DiffusionGemmaEngine(model, deterministic=True).read([mine])[0]  # nothing cached
    engine.read(others[:1])  # the schema is now cached
    mixed = engine.read([others[1], mine, others[2]])[1]
    again = engine.read([mine])[0]  # the whole prompt cached
    assert max_difference(alone, mixed) == 0.0
    assert max_difference(alone, again) == 0.0


def test_a_hidden_read_returns_the_state_its_label_logits_come_from(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw
) -> None:
    """lm_head then the final softcap 30 tanh(x / 30) of the returned hidden states give the label logits."""
    requests = [
        replace(make_request(ids, (12, 20), canvas=6, positions=(0, 3, 5), seed=1), hidden=True),
        make_request(ids, (9,), canvas=4, positions=(1,), seed=2),
        replace(make_request(ids, (5,), canvas=3, positions=(2,), seed=3), hidden=True),
    ]
    results = DiffusionGemmaEngine(model).read(requests)

    assert results[1].hidden is None
    cap = model.config.text_config.final_logit_softcapping
    for request, result in zip(requests[::2], results[::2], strict=True):
        assert result.hidden is not None and len(result.hidden) == len(request.slots)
        with torch.inference_mode():
            again = cap * torch.tanh(model.lm_head(torch.from_numpy(np.stack(result.hidden))).float() / cap)
        for slot, row, logits in zip(request.slots, again, result.logits, strict=True):
            np.testing.assert_allclose(row[list(slot.label_ids)].numpy(), logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_canvases", [64, 4])
def test_new_states_encoded_with_their_canvases_read_as_in_two_forwards(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, max_canvases: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decisions: states after one cached schema, several questions each. Encoding each state in the
    same forward as its canvases (``joint_encode``) reads as encoding it first, and caches it alike."""
    schema = ids(30)
    # states shorter and longer than the sliding window's 15 held tokens; two of one length
    states = [ids(n) for n in (6, 20, 9, 9)]
    requests = [
        ReadRequest((schema, state), ids(canvas), (Slot(canvas - 1, ids(3)),), seed=10 * k + q)
        for k, state in enumerate(states)
        for q, canvas in enumerate((4, 6, 3))
    ]
    engines = {
        joint: DiffusionGemmaEngine(model, max_canvases=max_canvases, shared_min=8, fast=FastPaths(joint_encode=joint))
        for joint in (True, False)
    }
    for engine in engines.values():
        engine.read([requests[0]])  # caches the schema and the first state
    joint = Calls(monkeypatch, "encode_decode")
    together = engines[True].read(requests)
    forwards = 2 if max_canvases == 64 else 3  # 9 and 9 tokens together, 20 apart; the 9s' 6 reads split at 4
    assert joint.count == forwards
    apart = engines[False].read(requests)
    assert joint.count == forwards
    for request, one, two in zip(requests, together, apart, strict=True):
        assert max_difference(one, two) <= 1e-5
        assert max_difference(one, DiffusionGemmaEngine(model).read([request])[0]) <= 1e-5
    # every state's whole prompt is cached: reading again decodes from the cache alone
    cache = engines[True].prefix_cache
    hits, joint = cache.hits, Calls(monkeypatch, "encode_decode")
    again = engines[True].read(requests)
    assert cache.hits == hits + len(states) and joint.count == 0
    assert all(max_difference(a, b) <= 1e-5 for a, b in zip(again, together, strict=True))


def test_states_of_different_lengths_share_one_joint_forward(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New states of 41 and 42 tokens (one length bucket, both past the sliding window) are encoded in
    one forward with their canvases, the shorter right-padded, and read as each read alone."""
    schema = ids(30)
    requests = [
        ReadRequest((schema, ids(length)), ids(5), (Slot(1, ids(3)), Slot(4, ids(4))), seed=length)
        for length in (41, 42, 41)
    ]
    engine = DiffusionGemmaEngine(model)
    engine.read([ReadRequest((schema,), ids(4), (Slot(0, ids(3)),))])  # caches the schema
    joint = Calls(monkeypatch, "encode_decode")
    together = engine.read(requests)
    assert joint.count == 1
    for request, one in zip(requests, together, strict=True):
        assert max_difference(one, DiffusionGemmaEngine(model).read([request])[0]) <= 1e-5
    # each state's KV was cached at its own length: reading again decodes from the cache alone
    again = engine.read(requests)
    assert all(max_difference(a, b) <= 1e-5 for a, b in zip(again, together, strict=True))


def test_isolated_questions_defer_their_states_into_one_joint_forward(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The isolated layout (instructions, then each question, then the state): every question's prompt
    continues its own cached parent, and all of them are encoded with their canvases in one forward."""
    instructions, questions, state = ids(40), [ids(n) for n in (7, 12, 9)], ids(22)
    requests = [
        ReadRequest((instructions, question, state), ids(6), (Slot(2, ids(3)),), seed=k)
        for k, question in enumerate(questions)
    ]
    engine = DiffusionGemmaEngine(model)
    for question in questions:  # caches each question after the instructions
        engine.read([ReadRequest((instructions, question), ids(4), (Slot(0, ids(3)),))])
    joint = Calls(monkeypatch, "encode_decode")
    together = engine.read(requests)
    assert joint.count == 1
    for request, one in zip(requests, together, strict=True):
        assert max_difference(one, DiffusionGemmaEngine(model).read([request])[0]) <= 1e-5
        assert (
            max_difference(one, DiffusionGemmaEngine(model, fast=FastPaths(joint_encode=False)).read([request])[0])
            <= 1e-5
        )


def test_segments_of_different_lengths_share_one_encoder_forward(
    model: DiffusionGemmaForBlockDiffusion, ids: Draw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Middle segments of 41 and 42 tokens (one length bucket) are encoded in one encoder forward."""
    schema = ids(30)
    requests = [ReadRequest((schema, ids(n), ids(5)), ids(4), (Slot(3, ids(3)),), seed=n) for n in (41, 42)]
    engine = DiffusionGemmaEngine(model, fast=FastPaths(joint_encode=False))
    engine.read([ReadRequest((schema,), ids(4), (Slot(0, ids(3)),))])  # caches the schema
    encodes = Calls(monkeypatch, "encode")
    together = engine.read(requests)
    assert encodes.count == 2  # the two middle segments, then the two last ones
    for request, one in zip(requests, together, strict=True):
        assert max_difference(one, DiffusionGemmaEngine(model).read([request])[0]) <= 1e-5
