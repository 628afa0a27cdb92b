"""Where thoughts go, on the real tokenizers: DiffusionGemma's thought channel, a causal reply's opener and cue."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotread.engines.base import Slot
from slotread.models.load import LoadedModel, load_tokenizer
from slotread.prompt.render import OptionText, QuestionText, Rendered, Renderer
from slotread.prompt.thinking import ANSWER_CUE, ThoughtFormat


def _noul(renderer: Renderer) -> QuestionText:
    options = (OptionText("yes", None), OptionText("no", None))
    return QuestionText("noul", "Is it urgent?", options, renderer.alphabet.yes_no)


def test_diffusion_thought_goes_in_the_channel(tiny_diffusion: LoadedModel) -> None:
    tokenizer = tiny_diffusion.tokenizer
    renderer = Renderer(tokenizer, "diffusion")
    form = ThoughtFormat.of(tokenizer, "diffusion")
    plain = renderer.render_branch(_noul(renderer), "My card is lost.")
    opened = form.thought_prompt(plain)
    assert tokenizer.decode(list(opened[-1])).endswith("<|channel>thought\n")
    assert opened[:-1] == plain.prompt[:-1]
    thought = tuple(tokenizer.encode("The card is gone, so yes.", add_special_tokens=False))
    read = form.with_thought(plain, thought)
    assert read.canvas == plain.canvas and read.slots == plain.slots
    text = tokenizer.decode([i for segment in read.prompt for i in segment])
    assert text.endswith("<|channel>thought\nThe card is gone, so yes.<channel|>")
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("<channel|>", "<turn|>")} <= form.stop_ids


def _causal_checks(tokenizer: object) -> None:
    renderer = Renderer(tokenizer, "causal")  # type: ignore[arg-type]
    form = ThoughtFormat.of(renderer.tokenizer, "causal")
    plain = renderer.render_branch(_noul(renderer), "My card is lost.")
    thought = tuple(renderer.tokenizer.encode(" The card is gone.", add_special_tokens=False))
    read = form.with_thought(plain, thought)
    assert read.prompt == plain.prompt  # the plain read's prefix KV serves the thinking read
    (slot,) = read.slots
    assert read.canvas[: len(form.opener)] == form.opener and read.canvas[slot.position] == plain.canvas[-1]
    assert form.thought_prompt(plain) == (*plain.prompt, form.opener)
    # after the cue each label is the one token it is at the start of a reply
    alphabet = renderer.alphabet
    for labels in (alphabet.yes_no, alphabet.letters, alphabet.digits, alphabet.pairs.take(30)):
        for text, label in zip(labels.texts, labels.ids, strict=True):
            full = ANSWER_CUE + labels.lead + (" " if labels.spaced else "") + text
            cue = renderer.tokenizer.encode(ANSWER_CUE + labels.lead, add_special_tokens=False)
            assert renderer.tokenizer.encode(full, add_special_tokens=False) == [*cue, label], text
    assert renderer.tokenizer.eos_token_id in form.stop_ids


def test_causal_thought_opens_the_reply_smollm2(smollm2: LoadedModel) -> None:
    _causal_checks(smollm2.tokenizer)


def test_causal_thought_opens_the_reply_qwen(cache_dir: Path) -> None:
    _causal_checks(load_tokenizer("qwen2.5-coder-1.5b-instruct", cache_dir=cache_dir).tokenizer)


def test_masked_models_write_no_thought(tiny_bert: LoadedModel) -> None:
    with pytest.raises(ValueError, match="writes no thought"):
        ThoughtFormat.of(tiny_bert.tokenizer, "masked")


def test_a_slot_moves_behind_the_thought() -> None:
    form = ThoughtFormat("causal", (1, 2), (3,), frozenset())
    read = form.with_thought(Rendered(((9, 9),), (5, 7), (Slot(1, (7, 8)),)), (4, 4, 4))
    assert read.canvas == (1, 2, 4, 4, 4, 3, 5, 7) and read.slots == (Slot(7, (7, 8)),)
