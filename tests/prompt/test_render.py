"""Prompt rendering through real chat templates and tokenizers."""

import pytest

from slotread.models.load import LoadedModel
from slotread.prompt.render import (
    CANVAS_BUCKET,
    EarlierAnswer,
    Layout,
    OptionText,
    QuestionText,
    Rendered,
    Renderer,
    SolvedExample,
)


@pytest.fixture(scope="module")
def causal(smollm2: LoadedModel) -> Renderer:
    return Renderer(smollm2.tokenizer, "causal")


@pytest.fixture(scope="module")
def diffusion(tiny_diffusion: LoadedModel) -> Renderer:
    return Renderer(tiny_diffusion.tokenizer, "diffusion")


@pytest.fixture(scope="module")
def plain_masked(tiny_bert: LoadedModel) -> Renderer:
    """A masked LM's tokenizer without a chat template: [CLS] and [SEP] come from its post-processor."""
    return Renderer(tiny_bert.tokenizer, "masked")


@pytest.fixture(scope="module")
def chat_masked(tiny_dream: LoadedModel) -> Renderer:
    """A masked-diffusion LM's tokenizer with a (ChatML) chat template."""
    return Renderer(tiny_dream.tokenizer, "masked")


def choice(renderer: Renderer, names: list[str], instructions: str | None = "Which intent?") -> QuestionText:
    options = tuple(OptionText(n, f"about {n}") for n in names)
    return QuestionText("choice", instructions, options, renderer.alphabet.choice(len(names)))


def noul(renderer: Renderer, instructions: str) -> QuestionText:
    return QuestionText(
        "noul", instructions, (OptionText("yes", None), OptionText("no", None)), renderer.alphabet.yes_no
    )


def test_causal_read_is_the_natural_tokenisation_of_prompt_and_answer(causal: Renderer) -> None:
    question = choice(causal, ["refund", "card_lost", "other"])
    read = causal.render_branch(question, "I lost my card", "Be brief.")
    (slot,) = read.slots
    tokenizer = causal.tokenizer
    for label, token in zip(question.labels.texts, question.labels.ids, strict=True):
        canvas = [*read.canvas[: slot.position], token]
        ids = [*read.prompt[0], *read.prompt[1], *canvas]
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids, label
    assert slot.label_ids == question.labels.ids


def test_prompt_holds_the_state_the_options_and_no_extra_text(causal: Renderer) -> None:
    question = choice(causal, ["refund", "card_lost"])
    read = causal.render_branch(question, "STATE-TEXT 한국어 🙂", "Be brief.")
    text = causal.tokenizer.decode([t for segment in read.prompt for t in segment])
    for expected in (
        "STATE-TEXT 한국어 🙂",
        "Be brief.",
        "A. refund: about refund",
        "B. card_lost: about card_lost",
    ):
        assert expected in text
    assert read.slots[0].position == 0 and read.canvas == (question.labels.ids[0],)
    assert text.index("STATE-TEXT") < text.index("Which intent?")


@pytest.mark.parametrize("layout", ["schema_first", "state_first"])
def test_the_cacheable_prefix_follows_the_layout(causal: Renderer, diffusion: Renderer, layout: Layout) -> None:
    for family in (causal, diffusion):
        renderer = Renderer(family.tokenizer, family.family, layout)
        question, other_question = choice(renderer, ["refund", "card_lost"]), choice(renderer, ["refund", "other"])
        one = renderer.render_branch(question, "first state", "Be brief.")
        two = renderer.render_branch(question, "a second, longer state", "Be brief.")
        other = renderer.render_branch(other_question, "first state", "Be brief.")
        # template head, instructions, then schema and request in the layout's order
        assert len(one.prompt) == 4 and one.prompt[:2] == two.prompt[:2] == other.prompt[:2]
        # the third segment is shared by reads of one question (schema first) or one state (state first)
        shared, differing = (two, other) if layout == "schema_first" else (other, two)
        assert one.prompt[2] == shared.prompt[2] and one.prompt[2] != differing.prompt[2]
        assert one.prompt[3] != shared.prompt[3]


def test_segments_split_the_whole_tokenisation_unchanged(
    causal: Renderer, diffusion: Renderer, plain_masked: Renderer, chat_masked: Renderer
) -> None:
    for renderer in (causal, diffusion, plain_masked, chat_masked):
        read = renderer.render_branch(choice(renderer, ["x", "y"]), "state\n\nwith lines")
        ids = [t for segment in read.prompt for t in segment]
        text = renderer.tokenizer.decode(ids)
        assert renderer.tokenizer.encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize(
    ("instructions", "state"),
    [
        ("Be brief.", "plain state"),
        ("trailing spaces   ", " state after a space"),
        ("x", "\n\nstate after blank lines"),
        ("tabs\there", "\tstate after a tab"),
    ],
)
def test_segments_tokenised_piece_by_piece_are_the_whole_tokenisation(
    causal: Renderer, diffusion: Renderer, instructions: str, state: str
) -> None:
    """Pieces between cuts are tokenised alone and remembered; where a token would straddle a cut the
    renderer tokenises the whole text, so the ids are always those of the whole prompt text."""
    for renderer in (causal, diffusion):
        question = choice(renderer, ["x", "y"], instructions="Which?" + instructions)
        first = renderer.render_branch(question, state, instructions)
        ids = [t for segment in first.prompt for t in segment]
        assert renderer.tokenizer.encode(renderer.tokenizer.decode(ids), add_special_tokens=False) == ids
        assert renderer.render_branch(question, state, instructions) == first  # from the remembered pieces


def test_diffusion_canvas_is_answer_slot_turn_end_and_pad(diffusion: Renderer) -> None:
    question = noul(diffusion, "Is it urgent?")
    read = diffusion.render_branch(question, "the server is down")
    (slot,) = read.slots
    tokenizer = diffusion.tokenizer
    assert len(read.canvas) % CANVAS_BUCKET == 0
    assert tokenizer.decode(read.canvas[: slot.position]) == "Answer:"
    assert read.canvas[slot.position] in question.labels.ids
    assert tokenizer.convert_ids_to_tokens(read.canvas[slot.position + 1]) == "<turn|>"
    assert set(read.canvas[slot.position + 2 :]) == {tokenizer.pad_token_id}
    prompt_text = tokenizer.decode([t for segment in read.prompt for t in segment])
    assert prompt_text.endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_joint_canvas_has_one_numbered_slot_per_question(diffusion: Renderer) -> None:
    questions = (
        noul(diffusion, "Is it urgent?"),
        choice(diffusion, ["billing", "outage", "other"]),
        QuestionText(
            "score",
            None,
            tuple(OptionText(str(i), t) for i, t in enumerate("abcde")),
            diffusion.alphabet.score(5),
        ),
    )
    read = diffusion.render_joint(questions, "the server is down")
    assert [s.label_ids for s in read.slots] == [q.labels.ids for q in questions]
    tokenizer = diffusion.tokenizer
    end = read.canvas.index(tokenizer.convert_tokens_to_ids("<turn|>"))
    text = tokenizer.decode(read.canvas[:end])
    assert text.startswith("1: Yes\n2: A\n3:") and text.count("\n") == 2
    assert tokenizer.encode(text, add_special_tokens=False) == list(read.canvas[:end])
    prompt_text = tokenizer.decode([t for segment in read.prompt for t in segment])
    assert "1. Is it urgent?" in prompt_text and "3. Where does the input fall on this scale?" in prompt_text


def test_a_chunk_lists_every_question_and_reads_its_own(diffusion: Renderer) -> None:
    questions = tuple(noul(diffusion, f"Question {n}?") for n in range(4))
    whole = diffusion.render_joint(questions, "s")
    chunk = diffusion.render_joint(questions, "s", read=(2, 3))
    tokenizer = diffusion.tokenizer
    end = chunk.canvas.index(tokenizer.convert_tokens_to_ids("<turn|>"))
    assert tokenizer.decode(chunk.canvas[:end]) == "3: Yes\n4: Yes" and len(chunk.slots) == 2
    # the schema segment (every question) is the same, so chunks share its cached KV
    assert chunk.prompt[:-1] == whole.prompt[:-1]
    assert "Answer questions 3, 4, one line each" in tokenizer.decode(chunk.prompt[-1])
    # rows: the canvas before its padding, "<turn|>" included
    assert diffusion.joint_rows(questions, (2, 3)) == end + 1 < len(chunk.canvas)
    assert diffusion.joint_rows(questions) > diffusion.joint_rows(questions[:2])


def test_joint_canvas_needs_a_diffusion_model(causal: Renderer) -> None:
    with pytest.raises(ValueError, match="diffusion"):
        causal.render_joint((noul(causal, "a?"), noul(causal, "b?")), "s")


def test_earlier_answers_follow_the_state(causal: Renderer, diffusion: Renderer, plain_masked: Renderer) -> None:
    for renderer in (causal, diffusion, plain_masked):
        earlier = (EarlierAnswer(noul(renderer, "Is it urgent?"), "Yes"),)
        read = renderer.render_branch(noul(renderer, "Escalate?"), "the server is down", earlier=earlier)
        text = renderer.tokenizer.decode([t for segment in read.prompt for t in segment])
        assert text.index("the server is down") < text.index("- Is it urgent? Yes") < text.index("Answer Yes or No.")


def test_plain_masked_read_is_cls_prompt_answer_slot_sep(plain_masked: Renderer) -> None:
    tokenizer = plain_masked.tokenizer
    question = choice(plain_masked, ["refund", "card_lost", "other"])
    read = plain_masked.render_branch(question, "I lost my card", "Be brief.")
    (slot,) = read.slots
    assert read.prompt[0] == (tokenizer.cls_token_id,)
    assert tokenizer.decode(read.canvas[: slot.position]) == "Answer:"
    assert read.canvas[slot.position + 1 :] == (tokenizer.sep_token_id,)
    ids = [t for segment in read.prompt for t in segment]
    text = tokenizer.decode(ids)
    # state first, the question next to the slot; nothing else between [CLS] and [SEP]
    assert text.startswith("[CLS]Be brief.\n\nI lost my card\n\nWhich intent?\nOptions:\nA. refund: about refund")
    assert text.endswith("Answer with the label of the best option.\n")
    for token in question.labels.ids:  # each label, in the slot, is the natural tokenisation of the whole text
        whole = [*ids, *read.canvas[: slot.position], token, *read.canvas[slot.position + 1 :]]
        assert tokenizer.encode(tokenizer.decode(whole), add_special_tokens=False) == whole


def test_chat_masked_canvas_ends_the_assistant_turn(chat_masked: Renderer) -> None:
    tokenizer = chat_masked.tokenizer
    read = chat_masked.render_branch(noul(chat_masked, "Is it urgent?"), "the server is down")
    (slot,) = read.slots
    prompt_text = tokenizer.decode([t for segment in read.prompt for t in segment])
    assert prompt_text.endswith("Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(read.canvas[: slot.position]) == "Answer:"
    assert tokenizer.convert_ids_to_tokens(list(read.canvas[slot.position + 1 :])) == ["<|im_end|>"]


def test_masked_joint_canvas_has_one_numbered_slot_per_question(plain_masked: Renderer) -> None:
    questions = (noul(plain_masked, "Is it urgent?"), choice(plain_masked, ["billing", "outage"]))
    read = plain_masked.render_joint(questions, "the server is down")
    assert [s.label_ids for s in read.slots] == [q.labels.ids for q in questions]
    assert plain_masked.tokenizer.decode(read.canvas) == "1: Yes\n2: A[SEP]"


def test_only_masked_models_go_without_a_chat_template(tiny_bert: LoadedModel) -> None:
    for family in ("causal", "diffusion"):
        with pytest.raises(ValueError, match="no chat template"):
            Renderer(tiny_bert.tokenizer, family)


def test_a_swapped_noul_says_what_its_labels_mean(causal: Renderer) -> None:
    yes, no = OptionText("yes", "they need it today"), OptionText("no", "it can wait")
    labels = causal.alphabet.yes_no
    plain = causal.render_branch(QuestionText("noul", "In a hurry?", (yes, no), labels), "s")
    swapped = causal.render_branch(QuestionText("noul", "In a hurry?", (no, yes), labels, swapped=True), "s")
    plain_text, swapped_text = (causal.tokenizer.decode(r.with_seed(0).prompt_ids) for r in (plain, swapped))
    assert '"Yes" means: they need it today\n"No" means: it can wait\nAnswer Yes or No.' in plain_text
    assert '"Yes" means: it can wait\n"No" means: they need it today\n' in swapped_text
    assert "answer No if the answer is yes, and Yes if the answer is no." in swapped_text
    assert plain.slots == swapped.slots  # the same two label tokens, in the same order


def test_solved_examples_come_after_the_schema_and_answer_in_the_reads_labels(
    causal: Renderer, diffusion: Renderer
) -> None:
    examples = (SolvedExample("EXAMPLE-ONE", "card_lost"), SolvedExample("EXAMPLE-TWO", "refund"))
    for renderer in (causal, diffusion):
        question = choice(renderer, ["refund", "card_lost", "other"])
        read = renderer.render_branch(question, "STATE-TEXT", "Be brief.", examples=examples)
        other = renderer.render_branch(question, "ANOTHER-STATE", "Be brief.", examples=examples[:1])
        text = renderer.tokenizer.decode([t for segment in read.prompt for t in segment])
        # schema first in every family with examples: its segment is shared by every state
        assert len(read.prompt) == 4 and read.prompt[:3] == other.prompt[:3]
        assert "Which intent?" in renderer.tokenizer.decode(read.prompt[2])
        assert text.index("Which intent?") < text.index("EXAMPLE-ONE") < text.index("EXAMPLE-TWO")
        assert text.index("EXAMPLE-TWO") < text.index("STATE-TEXT")
        # each example answers with its option's label in this listing: card_lost is B, refund A
        assert "Input:\nEXAMPLE-ONE\nAnswer: B\n\nInput:\nEXAMPLE-TWO\nAnswer: A\n\nInput:\nSTATE-TEXT" in text
        ids = [t for segment in read.prompt for t in segment]
        assert renderer.tokenizer.encode(renderer.tokenizer.decode(ids), add_special_tokens=False) == ids


def test_a_swapped_noul_example_answers_in_the_swapped_words(causal: Renderer) -> None:
    swapped = QuestionText(
        "noul", "Urgent?", (OptionText("no", None), OptionText("yes", None)), causal.alphabet.yes_no, swapped=True
    )
    read = causal.render_branch(swapped, "STATE", examples=(SolvedExample("send it now", "yes"),))
    text = causal.tokenizer.decode([t for segment in read.prompt for t in segment])
    assert "Input:\nsend it now\nAnswer: No\n" in text


@pytest.mark.parametrize(
    "state",
    [
        "plain state.",
        "ends with a newline\n",
        "ends with spaces   ",
        "ends with a blank line\n\n",
        "\n\nopens with blank lines",
        " opens with a space",
        "Input:\nlooks like the label",
        "tabs\tand emoji 🙂 한국어",
        "x",
    ],
)
def test_a_state_tokenised_apart_from_each_questions_text_gives_the_whole_texts_ids(
    causal: Renderer, diffusion: Renderer, chat_masked: Renderer, state: str
) -> None:
    """Schema first, the state is a piece of its own inside the last segment (so a decision tokenises it
    once); the reads equal those of the reference renderer, which tokenises every prompt whole and splits
    it at the segment cuts, for branches, joint canvases, earlier answers and solved examples."""
    for fast in (causal, diffusion, chat_masked):
        reference = Renderer(fast.tokenizer, fast.family, "schema_first")
        reference._joins = lambda left, right: False  # type: ignore[method-assign]  # always the whole text
        renderer = Renderer(fast.tokenizer, fast.family, "schema_first")
        for each in (renderer, reference):
            each.render_branch(choice(each, ["refund", "card_lost"]), "warm the pieces up", "Be brief.")
        assert _schema_first_reads(renderer, state) == _schema_first_reads(reference, state)


def _schema_first_reads(renderer: Renderer, state: str) -> list[Rendered]:
    question = choice(renderer, ["refund", "card_lost"])
    earlier = (EarlierAnswer(noul(renderer, "Is it urgent?"), "Yes"),)
    examples = (SolvedExample("an earlier message\n", "refund"), SolvedExample("another", "card_lost"))
    reads = [
        renderer.render_branch(question, state, "Be brief."),
        renderer.render_branch(question, state, None, earlier),
        renderer.render_branch(question, state, "Be brief.", (), examples),
    ]
    if renderer.joint:
        reads.append(renderer.render_joint((question, noul(renderer, "Is it urgent?")), state, "Be brief.", earlier))
    return reads


def test_a_decision_tokenises_its_state_once(diffusion: Renderer) -> None:
    renderer = Renderer(diffusion.tokenizer, "diffusion")
    state = "A state read by three questions, each with its own reply instruction."
    encoded: list[str] = []
    encode = renderer._encode
    renderer._encode = lambda text: encoded.append(text) or encode(text)  # type: ignore[method-assign]
    questions = [choice(renderer, ["a", "b"]), noul(renderer, "Is it urgent?"), choice(renderer, ["c", "d", "e"])]
    for question in questions:
        renderer.render_branch(question, state, "Be brief.")
    assert sum(state in text for text in encoded) == 1
