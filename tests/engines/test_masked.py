"""The masked engine against the model's own plain forward, on tiny random-weight BERT, ModernBERT and
a Dream-style remote-code model (tests/engines/tiny_dream.py), each loaded from a checkpoint directory.

The engine knows token ids only, so random ids stand in for prompts, canvases and labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, PreTrainedModel

from slotread.decider import Decider
from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.masked import MaskedAdapter, MaskedEngine
from slotread.errors import ModelLoadError, PromptTooLong
from slotread.models.load import LoadedModel
from slotread.models.masked_adapter import masked_adapter

Draw = Callable[[int], tuple[int, ...]]


@pytest.fixture(scope="module", params=["tiny_bert", "tiny_modernbert", "tiny_dream"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    model: LoadedModel = request.getfixturevalue(request.param)
    return model


def engine_for(loaded: LoadedModel, **options: int) -> MaskedEngine:
    adapter = masked_adapter(loaded.name, loaded.model.config, loaded.tokenizer)
    return MaskedEngine(loaded.model, adapter, **options)


@pytest.fixture
def ids(loaded: LoadedModel) -> Draw:
    """Draws random token ids of a given length (below the added special tokens), the same ones in every test."""
    generator = torch.Generator().manual_seed(1)
    vocab = loaded.tokenizer.vocab_size
    return lambda length: tuple(torch.randint(3, vocab, (length,), generator=generator).tolist())


def make_request(ids: Draw, segments: tuple[int, ...], canvas: int, positions: tuple[int, ...]) -> ReadRequest:
    """A request with prompt segments of the given lengths and 3 random labels per slot."""
    return ReadRequest(
        prompt=tuple(ids(length) for length in segments),
        canvas=ids(canvas),
        slots=tuple(Slot(position, ids(3)) for position in positions),
    )


def plain_logits(model: PreTrainedModel, request: ReadRequest, mask_id: int) -> torch.Tensor:
    """``model(input_ids).logits`` over the request's one unpadded sequence, slots masked: (T, V) float32."""
    sequence = [*request.prompt_ids, *request.canvas]
    for slot in request.slots:
        sequence[len(request.prompt_ids) + slot.position] = mask_id
    with torch.inference_mode():
        return model(input_ids=torch.tensor([sequence])).logits[0].float()


def max_difference(a: SlotScores, b: SlotScores) -> float:
    """The largest label-logit difference between two reads of the same request."""
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits, strict=True))


def test_slot_logits_match_a_plain_forward(loaded: LoadedModel, ids: Draw) -> None:
    engine = engine_for(loaded)
    offset = engine.adapter.read_offset
    requests = [
        make_request(ids, (5,), canvas=6, positions=(0, 3, 5)),
        make_request(ids, (12, 20, 8), canvas=9, positions=(2, 8)),  # 49 tokens: far past ModernBERT's local window
        make_request(ids, (23,), canvas=4, positions=(1,)),
    ]
    # Let the first slot's labels include the model's argmax there, so argmax_is_label is checked both ways.
    first = requests[0]
    top = int(plain_logits(loaded.model, first, engine.adapter.mask_id)[len(first.prompt_ids) + offset].argmax())
    requests[0] = ReadRequest(first.prompt, first.canvas, (Slot(0, (ids(1)[0], top)), *first.slots[1:]))

    results = engine.read(requests)

    worst_logit, worst_mass = 0.0, 0.0
    for request, result in zip(requests, results, strict=True):
        full = plain_logits(loaded.model, request, engine.adapter.mask_id)  # (T, V)
        for i, slot in enumerate(request.slots):
            row = full[len(request.prompt_ids) + slot.position + offset]
            assert result.logits[i].dtype == np.float32
            worst_logit = max(worst_logit, float(np.abs(result.logits[i] - row[list(slot.label_ids)].numpy()).max()))
            mass = float(torch.softmax(row.double(), dim=-1)[list(slot.label_ids)].sum())
            worst_mass = max(worst_mass, abs(result.label_mass[i] - mass) / mass)
            assert result.argmax_is_label[i] == (int(row.argmax()) in slot.label_ids)
            assert result.argmax_id[i] == int(row.argmax())
    assert results[0].argmax_is_label == (True, False, False)
    print(f"{loaded.name}: max |engine - plain| label logit {worst_logit:.3g}, relative label mass {worst_mass:.3g}")
    assert worst_logit <= 1e-5
    assert worst_mass <= 1e-4


@pytest.mark.parametrize("max_batch_rows", [16, 2, 1])
def test_a_read_is_the_same_alone_and_in_a_padded_batch(loaded: LoadedModel, ids: Draw, max_batch_rows: int) -> None:
    batch = [
        make_request(ids, (12,), canvas=10, positions=(4,)),
        make_request(ids, (30, 10), canvas=7, positions=(0, 6)),
        make_request(ids, (17, 9), canvas=3, positions=(0, 1, 2)),
        make_request(ids, (3,), canvas=2, positions=(1,)),
        make_request(ids, (6,), canvas=5, positions=(2,)),
    ]
    in_batch = engine_for(loaded, max_batch_rows=max_batch_rows).read(batch)
    alone_engine = engine_for(loaded)
    for request, result in zip(batch, in_batch, strict=True):
        alone = alone_engine.read([request])[0]
        difference = max_difference(alone, result)
        print(f"{len(request.prompt_ids) + len(request.canvas)} tokens: max difference {difference:.3g}")
        assert difference <= (0 if max_batch_rows == 1 else 1e-5)  # one row per forward: the same bits
        np.testing.assert_allclose(alone.label_mass, result.label_mass, rtol=1e-5)
        assert alone.argmax_id == result.argmax_id


def test_dream_reads_each_slot_one_position_early(tiny_dream: LoadedModel) -> None:
    engine = engine_for(tiny_dream)
    assert engine.adapter == MaskedAdapter(tiny_dream.tokenizer.mask_token_id, read_offset=-1, attention_mask="4d")
    request = ReadRequest(((11, 12, 13, 14),), (21, 22, 23), (Slot(1, (30, 31, 32)),))
    full = plain_logits(tiny_dream.model, request, engine.adapter.mask_id)
    got = engine.read([request])[0].logits[0]
    np.testing.assert_allclose(got, full[4, [30, 31, 32]], atol=1e-5)  # the token before the slot (position 5)
    assert float(np.abs(got - full[5, [30, 31, 32]].numpy()).max()) > 1e-2
    with pytest.raises(ValueError, match="outside the sequence"):
        engine.read([ReadRequest(((),), (21, 22), (Slot(0, (30,)),))])  # nothing before the slot to read it from


def test_the_slot_is_masked_whatever_the_canvas_holds(tiny_modernbert: LoadedModel) -> None:
    engine = engine_for(tiny_modernbert)
    one = ReadRequest(((5, 6, 7),), (8, 9, 10), (Slot(1, (40, 41)),), seed=0)
    other = ReadRequest(((5, 6, 7),), (8, 999, 10), (Slot(1, (40, 41)),), seed=None)
    first, second = engine.read([one, other])
    assert max_difference(first, second) <= 1e-6
    assert not engine.noisy


def test_a_model_without_an_lm_head_is_refused(tiny_bert_dir: Path) -> None:
    bare = AutoModel.from_pretrained(tiny_bert_dir, local_files_only=True)  # BertModel: hidden states, no logits
    with pytest.raises(ModelLoadError, match="no linear output embedding"):
        MaskedEngine(bare, MaskedAdapter(0))


def test_bad_requests_are_refused(tiny_bert: LoadedModel) -> None:
    engine = engine_for(tiny_bert, max_tokens=32)
    vocab = tiny_bert.model.config.vocab_size
    with pytest.raises(PromptTooLong):
        engine.read([ReadRequest((tuple(range(5, 35)),), (1, 2, 3), (Slot(0, (4,)),))])
    bad = [
        ReadRequest(((5, 6),), (1, 2, 3), (Slot(3, (4,)),)),  # slot past the canvas
        ReadRequest(((5, 6),), (1, 2, 3), (Slot(0, ()),)),  # no labels
        ReadRequest(((5, 6),), (1, 2, 3), (Slot(0, (vocab,)),)),  # label outside the vocabulary
        ReadRequest(((5, 6),), (1, 2, 3), ()),  # no slots
    ]
    for request in bad:
        with pytest.raises(ValueError):
            engine.read([request])
    with pytest.raises(ModelLoadError, match="outside its vocabulary"):
        MaskedEngine(tiny_bert.model, MaskedAdapter(vocab))


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_dream"])
def test_a_decision_on_a_masked_model(name: str, request: pytest.FixtureRequest) -> None:
    decider = Decider(request.getfixturevalue(name))
    assert isinstance(decider.engine, MaskedEngine) and decider.renderer.family == "masked"
    body = {
        "state": "My card never arrived and I need to pay rent tomorrow.",
        "questions": {
            "urgent": {"type": "noul", "instructions": "Is it urgent?"},
            "intent": {"type": "choice", "criteria": {"refund": "money back", "replacement": None, "other": None}},
            "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
        },
    }
    for joint in (False, True):
        response = decider.decide({**body, "x_joint": joint})
        got = response["answers"]
        assert list(got) == ["urgent", "intent", "mood"]
        assert 0 <= got["urgent"]["noul"] <= 1
        assert got["intent"]["choice"] == max(got["intent"]["probabilities"], key=got["intent"]["probabilities"].get)
        for answer in (got["intent"], got["mood"]):
            assert abs(sum(answer["probabilities"].values()) - 1) < 1e-9
            assert 0 <= answer["confidence"] <= 1
        assert all(answer["x_reads"] == 1 and 0 < answer["x_label_mass"] <= 1 for answer in got.values())
        assert response["usage"]["output_tokens"] == 3


def test_a_hidden_read_returns_the_state_its_label_logits_come_from(loaded: LoadedModel, ids: Draw) -> None:
    """The output embedding applied to the returned hidden states gives the returned label logits."""
    engine = engine_for(loaded, max_batch_rows=2)
    plain = make_request(ids, (7,), canvas=5, positions=(2,))
    asked = [
        make_request(ids, (5,), canvas=6, positions=(0, 3, 5)),
        make_request(ids, (12, 9), canvas=4, positions=(1,)),
    ]
    requests = [replace(asked[0], hidden=True), plain, replace(asked[1], hidden=True)]

    results = engine.read(requests)

    assert results[1].hidden is None
    head = loaded.model.get_output_embeddings()
    for request, result in zip(requests[::2], results[::2], strict=True):
        assert result.hidden is not None and len(result.hidden) == len(request.slots)
        with torch.inference_mode():
            again = head(torch.from_numpy(np.stack(result.hidden))).float()  # (slots, V)
        for slot, row, logits in zip(request.slots, again, result.logits, strict=True):
            np.testing.assert_allclose(row[list(slot.label_ids)].numpy(), logits, atol=1e-5, rtol=0)
