"""Label alphabets on real tokenizers, verified in the answer template's context."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slotread.errors import ModelLoadError
from slotread.models.load import LoadedModel
from slotread.prompt.labels import MAX_CHOICE_OPTIONS, build_alphabet
from slotread.prompt.render import OptionText, QuestionText, Renderer


@pytest.fixture(scope="module", params=["smollm2", "tiny_diffusion"])
def renderer(request: pytest.FixtureRequest) -> Renderer:
    loaded: LoadedModel = request.getfixturevalue(request.param)
    return Renderer(loaded.tokenizer, loaded.family)


def test_255_distinct_single_token_choice_labels(renderer: Renderer) -> None:
    labels = renderer.alphabet.choice(MAX_CHOICE_OPTIONS)
    assert len(labels.texts) == len(set(labels.texts)) == MAX_CHOICE_OPTIONS
    assert len(set(labels.ids)) == MAX_CHOICE_OPTIONS
    for text, token in zip(labels.texts, labels.ids, strict=True):
        assert renderer.tokenizer.decode([token]).strip() == text


def test_small_choices_use_letters_and_scores_digits(renderer: Renderer) -> None:
    alphabet = renderer.alphabet
    assert alphabet.choice(3).texts == ("A", "B", "C")
    assert alphabet.choice(27).texts[:2] == ("AA", "AB")
    assert alphabet.score(10).texts == tuple("0123456789")
    assert alphabet.yes_no.texts == ("Yes", "No")


def test_label_is_one_token_after_the_reply_prefix(renderer: Renderer) -> None:
    tokenizer = renderer.tokenizer
    noul = QuestionText("noul", None, (OptionText("yes", None), OptionText("no", None)), renderer.alphabet.yes_no)
    read = renderer.render_branch(noul, "s")
    prompt = tokenizer.decode([token for segment in read.prompt for token in segment])
    context = renderer.reply_prefix if renderer.family == "diffusion" else prompt
    for labels in (renderer.alphabet.choice(40), renderer.alphabet.score(10), renderer.alphabet.yes_no):
        prefix = tokenizer.encode(context + labels.lead, add_special_tokens=False)
        for text, token in zip(labels.texts, labels.ids, strict=True):
            label = (" " if labels.spaced else "") + text
            assert tokenizer.encode(context + labels.lead + label, add_special_tokens=False) == [*prefix, token]


def test_labels_start_a_causal_reply_bare(smollm2: LoadedModel) -> None:
    alphabet = Renderer(smollm2.tokenizer, "causal").alphabet
    assert (alphabet.letters.lead, alphabet.letters.spaced) == ("", False)
    assert smollm2.tokenizer.convert_ids_to_tokens(list(alphabet.yes_no.ids)) == ["Yes", "No"]


def test_a_tokenizer_without_enough_labels_fails_at_load() -> None:
    # A real word-level tokenizer that knows letters and digits but no two-letter tokens.
    vocab = {t: i for i, t in enumerate(["[UNK]", "Answer", ":", "Yes", "No", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(ModelLoadError, match="255"):
        build_alphabet(tokenizer, "Answer:")
