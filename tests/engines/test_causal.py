"""The causal engine against the model's own full forward, on tiny random-weight real architectures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.causal import CausalEngine, plan_waves
from slotread.engines.prefix_cache import PrefixCache
from slotread.errors import ModelLoadError, PromptTooLong

VOCAB = 1000
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**SHAPE),
    "qwen2": Qwen2Config(**SHAPE),
    # A sliding window far shorter than the prompts, and a softcap small enough to bend the logits.
    "gemma3": Gemma3TextConfig(
        **SHAPE,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=2.0,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[request.param], dtype=torch.float32).eval()


@pytest.fixture
def ids() -> Callable[[int], tuple[int, ...]]:
    """Draws random token ids of a given length, the same ones in every test."""
    generator = torch.Generator().manual_seed(1)

    def draw(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, VOCAB, (length,), generator=generator).tolist())

    return draw


def full_logits(model: PreTrainedModel, request: ReadRequest) -> torch.Tensor:
    """The model's own next-token logits over ``prompt + canvas[:p]``, (V,) float32."""
    fed = request.prompt_ids + request.canvas[: request.slots[0].position]
    with torch.inference_mode():
        return model(input_ids=torch.tensor([fed])).logits[0, -1].float()


def max_difference(a: list[SlotScores], b: list[SlotScores]) -> float:
    """The largest difference in label logits or label mass between two read results."""
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.argmax_is_label == y.argmax_is_label
        for lx, ly in zip(x.logits, y.logits, strict=True):
            worst = max(worst, float(np.abs(lx - ly).max()))
        worst = max(worst, *(abs(mx - my) for mx, my in zip(x.label_mass, y.label_mass, strict=True)))
    return worst


@contextmanager
def fed_shapes(model: PreTrainedModel) -> Iterator[list[tuple[int, int]]]:
    """Record the (rows, tokens) shape of every forward the model runs."""
    shapes: list[tuple[int, int]] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, args: shapes.append(tuple(args[0].shape))
    )
    try:
        yield shapes
    finally:
        hook.remove()


def branches(ids, shared: tuple[tuple[int, ...], ...], count: int, labels=(5, 6, 7)) -> list[ReadRequest]:
    """``count`` questions on one shared prompt prefix, each with a 3-token reply prefix and a slot."""
    return [
        ReadRequest(prompt=(*shared, ids(3 + 2 * i)), canvas=(*ids(3), 0), slots=(Slot(3, labels),))
        for i in range(count)
    ]


def test_slot_logits_equal_the_full_forward(model, ids) -> None:
    requests = [
        ReadRequest(prompt=(ids(10), ids(25), ids(6)), canvas=(*ids(4), 0), slots=(Slot(4, (1, 2, 3)),)),
        # The slot inside the canvas: nothing from it on is fed.
        ReadRequest(prompt=(ids(17),), canvas=ids(9), slots=(Slot(5, (10, 11)), Slot(5, (12, 12, 13)))),
        # The slot first in the canvas: read at the last prompt token.
        ReadRequest(prompt=(ids(4), ids(3)), canvas=ids(2), slots=(Slot(0, (40, 41, 42)),)),
    ]
    # One slot whose labels hold the model's own choice, so argmax_is_label can be True.
    choice = int(full_logits(model, requests[0]).argmax())
    requests.append(ReadRequest(requests[0].prompt, requests[0].canvas, (Slot(4, (choice, 1)),)))

    scores = CausalEngine(model).read(requests)

    for request, result in zip(requests, scores, strict=True):
        expected = full_logits(model, request)
        probabilities = expected.softmax(-1)
        for slot, logits, mass, hit in zip(
            request.slots, result.logits, result.label_mass, result.argmax_is_label, strict=True
        ):
            assert logits.dtype == np.float32
            np.testing.assert_allclose(logits, expected[list(slot.label_ids)].numpy(), atol=1e-4, rtol=0)
            assert mass == pytest.approx(float(probabilities[sorted(set(slot.label_ids))].sum()), abs=1e-6)
            assert hit == (int(expected.argmax()) in slot.label_ids)
    assert scores[-1].argmax_is_label == (True,)


def test_a_result_does_not_depend_on_the_batch(model, ids) -> None:
    state_a, state_b = (ids(9), ids(30)), (ids(21), ids(4))
    requests = [
        *branches(ids, state_a, 3),
        *branches(ids, state_b, 2, labels=(7, 8)),
        ReadRequest(prompt=(ids(13),), canvas=(*ids(6), 0), slots=(Slot(6, (3, 4)),)),
        ReadRequest(prompt=(ids(2), ids(40), ids(1)), canvas=(0,), slots=(Slot(0, (9, 10, 11, 12)),)),
    ]
    alone = [CausalEngine(model).read([request])[0] for request in requests]

    together = CausalEngine(model).read(requests)
    reversed_order = CausalEngine(model).read(requests[::-1])[::-1]
    batched = CausalEngine(model, max_batch_rows=32).read(requests)
    chunked = CausalEngine(model, max_batch_rows=2).read(requests)

    assert max_difference(alone, together) == 0  # one row per forward: the same bits
    assert max_difference(alone, reversed_order) == 0
    assert max_difference(alone, batched) <= 1e-5  # batched rows round per batch shape
    assert max_difference(alone, chunked) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_by_row_reads_are_bit_identical_in_any_batch_and_cache_state(ids, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["qwen2"], dtype=dtype).eval()
    system = ids(12)
    requests = [*branches(ids, (system, ids(30)), 3), *branches(ids, (system, ids(17)), 2, labels=(7, 8))]
    alone = [CausalEngine(model).read([request])[0] for request in requests]
    engine = CausalEngine(model)

    cold = engine.read(requests)
    warm = engine.read(requests[::-1])[::-1]  # every boundary prefix from the cache
    partly = CausalEngine(model)
    partly.read([ReadRequest(prompt=(system, ids(5)), canvas=(0,), slots=(Slot(0, (3,)),))])  # caches the system

    assert all(max_difference(alone, other) == 0 for other in (cold, warm, partly.read(requests)))


def test_a_second_read_reuses_the_cached_prefixes(model, ids) -> None:
    requests = branches(ids, (ids(12), ids(30)), 3)
    engine = CausalEngine(model)
    with fed_shapes(model) as cold_shapes:
        cold = engine.read(requests)
    hits = engine.prefix_cache.hits
    with fed_shapes(model) as warm_shapes:
        warm = engine.read(requests)

    assert engine.prefix_cache.hits == hits + 1
    # segment by segment, then each branch (3, 5 and 7 question tokens, 3 reply tokens) in a row of its own
    assert cold_shapes == [(1, 12), (1, 30), (1, 6), (1, 8), (1, 10)]
    assert warm_shapes == [(1, 6), (1, 8), (1, 10)]
    assert max_difference(cold, warm) == 0


def test_results_do_not_depend_on_segment_boundaries(model, ids) -> None:
    system, state, question = ids(11), ids(23), ids(7)
    canvas, slots = (*ids(3), 0), (Slot(3, (20, 21, 22)),)
    splits = [
        (system + state + question,),
        (system, state, question),
        (system + state, question),
        (system, state + question),
        ((), system, (), state, question, ()),
    ]
    engine = CausalEngine(model)
    results = [CausalEngine(model).read([ReadRequest(split, canvas, slots)])[0] for split in splits]
    # The same splits again on one engine, so later splits start from prefixes others cached.
    shared = [engine.read([ReadRequest(split, canvas, slots)])[0] for split in splits]

    assert max_difference(results[:1] * len(splits), results) <= 1e-5
    assert max_difference(results, shared) <= 1e-5


def test_a_shared_prefix_is_encoded_once(model, ids) -> None:
    system, state = ids(15), ids(25)
    engine = CausalEngine(model, max_batch_rows=32)
    with fed_shapes(model) as shapes:
        engine.read(branches(ids, (system, state), 8))

    assert engine.prefix_cache.misses == 2  # system + state, then system: each probed once
    assert len(engine.prefix_cache) == 2
    assert shapes == [(1, 15), (1, 25), (8, 20)]

    # A second state after the same system: the system is a hit, only the new state is encoded.
    with fed_shapes(model) as shapes:
        engine.read(branches(ids, (system, ids(9)), 4))
    assert (engine.prefix_cache.hits, engine.prefix_cache.misses) == (1, 3)
    assert shapes == [(1, 9), (4, 12)]


def test_nested_branch_points_are_encoded_once_each(model, ids) -> None:
    system = ids(14)
    requests = [*branches(ids, (system, ids(20)), 3), *branches(ids, (system, ids(16)), 3)]
    engine = CausalEngine(model, max_batch_rows=32)
    with fed_shapes(model) as shapes:
        scores = engine.read(requests)

    assert shapes == [(1, 14), (2, 20), (6, 10)]
    for request, result in zip(requests, scores, strict=True):
        expected = full_logits(model, request)[list(request.slots[0].label_ids)].numpy()
        np.testing.assert_allclose(result.logits[0], expected, atol=1e-4, rtol=0)


def test_plan_waves_encodes_each_missing_segment_once_in_a_row_of_its_own() -> None:
    fed = [(1, 2, 3, 4, 5), (1, 2, 3, 6), (7, 8, 9), (1, 2, 3, 7)]
    boundaries = [[2, 3], [2, 3], [1], [3]]  # the last request passes (1, 2, 3) without its inner boundary

    waves = plan_waves(fed, boundaries, is_cached=lambda prefix: prefix == (1, 2))

    assert [[(row.parent, row.tokens, row.request) for row in wave] for wave in waves] == [
        [((1, 2), (3,), None), ((), (7,), None)],
        [((1, 2, 3), (4, 5), 0), ((1, 2, 3), (6,), 1), ((7,), (8, 9), 2), ((1, 2, 3), (7,), 3)],
    ]


def test_a_cache_too_small_to_hold_anything_changes_nothing(model, ids) -> None:
    requests = [*branches(ids, (ids(10), ids(20)), 3), *branches(ids, (ids(5),), 2)]
    expected = CausalEngine(model).read(requests)

    engine = CausalEngine(model, prefix_cache=PrefixCache(max_bytes=0))
    assert max_difference(expected, engine.read(requests)) <= 1e-5
    assert len(engine.prefix_cache) == 0


BAD_REQUESTS = {
    "no slots": ReadRequest(((1,) * 20,), (2,) * 5, ()),
    "two slot positions": ReadRequest(((1,) * 20,), (2,) * 5, (Slot(2, (1,)), Slot(4, (2,)))),
    "position past the canvas": ReadRequest(((1,) * 20,), (2,) * 5, (Slot(6, (1,)),)),
    "label outside the vocabulary": ReadRequest(((1,) * 20,), (2,) * 5, (Slot(2, (1, VOCAB)),)),
    "no labels": ReadRequest(((1,) * 20,), (2,) * 5, (Slot(2, ()),)),
    "nothing to feed": ReadRequest((), (2,) * 5, (Slot(0, (1,)),)),
}


@pytest.mark.parametrize("reason", sorted(BAD_REQUESTS))
def test_a_malformed_request_is_refused(model, reason: str) -> None:
    with pytest.raises(ValueError, match="request 1: "):
        good = ReadRequest((), (3, 4), (Slot(1, (5,)),))
        CausalEngine(model).read([good, BAD_REQUESTS[reason]])


def test_a_prompt_over_max_tokens_is_refused(model) -> None:
    engine = CausalEngine(model, max_tokens=50)
    with pytest.raises(PromptTooLong):
        engine.read([ReadRequest(((1,) * 48,), (2,) * 5, (Slot(3, (1,)),))])
    engine.read([ReadRequest(((1,) * 47,), (2,) * 5, (Slot(3, (1,)),))])  # exactly 50 tokens fed


def test_the_engine_describes_itself(model) -> None:
    engine = CausalEngine(model)
    assert (engine.family, engine.noisy, engine.max_tokens) == ("causal", False, 512)
    assert CausalEngine(model, max_tokens=64).max_tokens == 64


def test_an_unknown_logit_transform_is_refused() -> None:
    # HyperCLOVAX multiplies its logits by ``logits_scaling``, where Granite divides by it.
    config = AutoConfig.for_model("hyperclovax", **SHAPE, logits_scaling=4.0)
    torch.manual_seed(0)
    with pytest.raises(ModelLoadError, match="HyperCLOVAX"):
        CausalEngine(AutoModelForCausalLM.from_config(config))


def test_a_module_that_is_not_a_transformers_model_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="Linear"):
        CausalEngine(torch.nn.Linear(4, 4))


@pytest.mark.slow
def test_real_smollm2_branches_equal_full_forwards(smollm2) -> None:
    tokenizer, model = smollm2.tokenizer, smollm2.model

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    system = encode("<|im_start|>system\nAnswer each question about the review with yes or no.<|im_end|>\n")
    state = encode("<|im_start|>user\nReview: The film was a joy from start to finish; I laughed a lot.\n")
    questions = ["Is the review positive?", "Is the review negative?", "Does the reviewer mention music?"]
    labels = (*encode(" yes"), *encode(" no"))
    assert len(labels) == 2
    requests = [
        ReadRequest(
            prompt=(system, state, encode(f"{question}<|im_end|>\n<|im_start|>assistant\n")),
            canvas=(*encode("Answer:"), labels[0]),
            slots=(Slot(len(encode("Answer:")), labels),),
        )
        for question in questions
    ]
    engine = CausalEngine(model)
    with fed_shapes(model) as shapes:
        scores = engine.read(requests)

    assert [rows for rows, _ in shapes] == [1] * 5  # system, state, then each branch
    for request, result in zip(requests, scores, strict=True):
        expected = full_logits(model, request)
        np.testing.assert_allclose(result.logits[0], expected[list(labels)].numpy(), atol=1e-4, rtol=0)
    alone = [CausalEngine(model).read([request])[0] for request in requests]
    assert max_difference(alone, scores) == 0
    # Batched rows round per batch shape, and rounding grows with the logits (about 20 here): measured
    # 1.2e-5, about 6e-7 of the logit size.
    batched = CausalEngine(model, max_batch_rows=32).read(requests)
    scale = max(float(np.abs(result.logits[0]).max()) for result in scores)
    assert max_difference(alone, batched) <= 2e-6 * scale


def test_a_hidden_read_returns_the_state_its_label_logits_come_from(model, ids) -> None:
    """lm_head of the returned hidden state, then the model's softcap, gives the returned label logits."""
    requests = [
        ReadRequest(prompt=(ids(10), ids(6)), canvas=(*ids(4), 0), slots=(Slot(4, (1, 2, 3)),), hidden=True),
        ReadRequest(prompt=(ids(17),), canvas=ids(9), slots=(Slot(5, (10, 11)), Slot(5, (12, 13))), hidden=True),
        ReadRequest(prompt=(ids(4), ids(3)), canvas=ids(2), slots=(Slot(0, (40, 41, 42)),)),
    ]
    results = CausalEngine(model).read(requests)

    assert results[2].hidden is None
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    for request, result in zip(requests[:2], results[:2], strict=True):
        assert result.hidden is not None and len(result.hidden) == len(request.slots)
        for slot, hidden, logits in zip(request.slots, result.hidden, result.logits, strict=True):
            assert hidden.dtype == np.float32 and hidden.shape == (model.config.hidden_size,)
            with torch.inference_mode():
                again = model.get_output_embeddings()(torch.from_numpy(hidden)).float()
            if cap:
                again = cap * torch.tanh(again / cap)
            np.testing.assert_allclose(again[list(slot.label_ids)].numpy(), logits, atol=1e-5, rtol=0)
    # the hidden state is the model's own final (normed) hidden state at the read row
    fed = requests[0].prompt_ids + requests[0].canvas[:4]
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([fed]), output_hidden_states=True).hidden_states
    assert results[0].hidden is not None
    np.testing.assert_allclose(results[0].hidden[0], states[-1][0, -1].numpy(), atol=1e-5, rtol=0)


def test_bfloat16_label_logits_are_exact_not_rounded_to_bfloat16(ids) -> None:
    """The label logits of a bfloat16 model come from its hidden state and the label rows summed in float64."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["gemma3"], dtype=torch.bfloat16).eval()
    request = ReadRequest(
        prompt=(ids(10), ids(6)), canvas=(*ids(4), 0), slots=(Slot(4, tuple(range(40))),), hidden=True
    )

    (result,) = CausalEngine(model).read([request])

    assert result.hidden is not None
    hidden = torch.from_numpy(result.hidden[0]).double()  # the bfloat16 state, widened exactly
    rows = model.get_output_embeddings().weight[:40].detach().double()
    cap = 2.0  # the gemma3 config's softcap
    expected = (cap * torch.tanh(rows @ hidden / cap)).float().numpy()
    np.testing.assert_array_equal(result.logits[0], expected)
    # lm_head in bfloat16, widened after, would sit on bfloat16's grid; these do not
    on_grid = torch.from_numpy(result.logits[0]).bfloat16().float().numpy() == result.logits[0]
    assert on_grid.sum() <= 2
