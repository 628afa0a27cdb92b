"""Label alphabets on real tokenizers, verified in the answer template's context."""

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from slotread.errors import ModelLoadError
from slotread.models.load import LoadedModel
from slotread.prompt.labels import DIGITS, LETTERS, MAX_CHOICE_OPTIONS, PAIRS, YES_NO, build_alphabet
from slotread.prompt.render import OptionText, QuestionText, Renderer


@pytest.fixture(scope="module", params=["smollm2", "tiny_diffusion", "tiny_bert", "tiny_dream"])
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
    context = prompt if renderer.family == "causal" else renderer.reply_prefix
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


def test_a_lowercasing_wordpiece_tokenizer_reads_labels_in_a_plain_masked_prompt() -> None:
    # BERT's own recipe (lower-casing normaliser, WordPiece with ## pieces, [CLS] ... [SEP]), trained here on
    # text that holds every label, since no BERT vocabulary installs here.
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    corpus = [" ".join(LETTERS + PAIRS + DIGITS + YES_NO), "Answer: which option fits the input best? I lost my card."]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=3000, special_tokens=specials))
    backend.post_processor = processors.BertProcessing(
        ("[SEP]", backend.token_to_id("[SEP]")), ("[CLS]", backend.token_to_id("[CLS]"))
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )
    assert tokenizer.tokenize("Cardigan") == ["card", "##i", "##g", "##a", "##n"]

    renderer = Renderer(tokenizer, "masked")
    alphabet = renderer.alphabet
    assert alphabet.choice(MAX_CHOICE_OPTIONS).texts[:2] == ("AA", "AB")
    assert tokenizer.convert_ids_to_tokens([*alphabet.letters.ids[:2], *alphabet.yes_no.ids]) == ["a", "b", "yes", "no"]
    question = QuestionText(
        "choice", "Which intent?", (OptionText("refund", None), OptionText("other", None)), alphabet.choice(2)
    )
    read = renderer.render_branch(question, "I lost my card")
    (slot,) = read.slots
    assert read.prompt[0] == (tokenizer.cls_token_id,) and read.canvas[slot.position + 1 :] == (tokenizer.sep_token_id,)
    prefix = tokenizer.encode("Answer:", add_special_tokens=False)
    assert read.canvas[: slot.position] == tuple(prefix)
    for text, token in zip(question.labels.texts, question.labels.ids, strict=True):
        assert tokenizer.encode(f"Answer: {text}[SEP]", add_special_tokens=False) == [
            *prefix,
            token,
            tokenizer.sep_token_id,
        ]
