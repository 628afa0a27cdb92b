"""Render questions through the model's own chat template into token ids, slots and label ids.

The prompt layout is fixed (layouts change answers) and schema-first, so that one question's text
is a prompt prefix shared by every state it is asked about and can be cached:

    [chat template head] [request instructions] [question + options]   <- segment 1: the schema
    [the state] [earlier answers] [reply instruction] [template tail]  <- segment 2: this request
    canvas: [reply prefix "Answer:"] [slot] (+ "<turn|>" and pad on DiffusionGemma)

A causal model reads the slot as its next token after the reply prefix. DiffusionGemma gets the
empty thought block after the template tail (outside the canvas) and reads every slot of a fixed
length canvas in one decoder step. A joint canvas (DiffusionGemma only) numbers the questions in
one prompt and puts one "n: <slot>" line per question in the canvas.

This module knows text and tokenizers, not wire formats or engines' internals.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from slotread.engines.base import Family, ReadRequest, Slot
from slotread.prompt.labels import Alphabet, LabelSet, build_alphabet

REPLY_PREFIX = "Answer:"
#: DiffusionGemma's empty thought block, placed after the generation prompt, outside the canvas.
THOUGHT_BLOCK = "<|channel>thought\n<channel|>"
TURN_END = "<turn|>"
#: DiffusionGemma canvases come in multiples of this many tokens, so most reads share one shape.
CANVAS_BUCKET = 16

QuestionKind = Literal["noul", "choice", "score"]
Layout = Literal["schema_first", "state_first"]
#: The prompt layout per family, fixed because the layout changes answers. LAYOUT_NOTE
LAYOUTS: dict[Family, Layout] = {"causal": "schema_first", "diffusion": "schema_first"}


@dataclass(frozen=True)
class OptionText:
    """An option as the model sees it: its name and optional description."""

    name: str
    description: str | None


@dataclass(frozen=True)
class QuestionText:
    """A question as the model sees it: no id, just its text, options and labels."""

    kind: QuestionKind
    instructions: str | None
    options: tuple[OptionText, ...]
    labels: LabelSet


@dataclass(frozen=True)
class EarlierAnswer:
    """An answer from an earlier stage that a later question sees."""

    question: QuestionText
    answer: str


@dataclass(frozen=True)
class Rendered:
    """A read without its seed: prompt segments, canvas, slots (in question order)."""

    prompt: tuple[tuple[int, ...], ...]
    canvas: tuple[int, ...]
    slots: tuple[Slot, ...]

    def with_seed(self, seed: int) -> ReadRequest:
        """The engine request for one noise draw."""
        return ReadRequest(self.prompt, self.canvas, self.slots, seed)

    @property
    def tokens(self) -> int:
        """Prompt plus canvas tokens."""
        return sum(map(len, self.prompt)) + len(self.canvas)


def _default_instructions(kind: QuestionKind) -> str:
    return {
        "noul": "Is the following true of the input?",
        "choice": "Which option fits the input best?",
        "score": "Where does the input fall on this scale?",
    }[kind]


def _describe(text: str | None) -> str:
    return f": {text}" if text else ""


def heading(question: QuestionText) -> str:
    """The question's own words, or a default for its kind."""
    return question.instructions or _default_instructions(question.kind)


def question_block(question: QuestionText) -> str:
    """The schema text of one question: its instructions and one line per option."""
    lines = [f"Question: {heading(question)}"]
    if question.kind == "noul":
        yes, no = question.options
        if yes.description:
            lines.append(f'"Yes" means: {yes.description}')
        if no.description:
            lines.append(f'"No" means: {no.description}')
    elif question.kind == "choice":
        lines.append("Options:")
        lines += [
            f"{label}. {option.name}{_describe(option.description)}"
            for label, option in zip(question.labels.texts, question.options, strict=True)
        ]
    else:
        lines.append("Levels, from lowest to highest:")
        lines += [
            f"{label}. {option.description or option.name}"
            for label, option in zip(question.labels.texts, question.options, strict=True)
        ]
    return "\n".join(lines)


def reply_instruction(question: QuestionText) -> str:
    """What the reply must be, as the last line of the user turn."""
    if question.kind == "noul":
        return "Answer Yes or No."
    if question.kind == "choice":
        return "Answer with the label of the best option."
    return f"Answer with the number of the level (0-{len(question.options) - 1})."


class Renderer:
    """Turns question texts into engine reads for one tokenizer and model family.

    Builds and verifies the tokenizer's label alphabet in the reply context at construction.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, family: Family, layout: Layout | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.family = family
        self.layout: Layout = layout or LAYOUTS[family]
        self._after_slot = TURN_END if family == "diffusion" else ""
        prefix = REPLY_PREFIX if family == "diffusion" else self._template("Question?") + REPLY_PREFIX
        self.alphabet: Alphabet = build_alphabet(tokenizer, prefix, self._after_slot)

    def _template(self, content: str) -> str:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text + (THOUGHT_BLOCK if self.family == "diffusion" else "")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _segments(self, text: str, cuts: list[int]) -> tuple[tuple[int, ...], ...]:
        """Tokenise ``text`` whole and split the ids where the character offsets ``cuts`` fall.

        A token straddling a cut goes to the later segment, so splitting never changes the ids.
        """
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = encoding["input_ids"]
        offsets: list[tuple[int, int]] = encoding["offset_mapping"]
        splits = [next((i for i, (_, end) in enumerate(offsets) if end > cut), len(ids)) for cut in cuts]
        bounds = [0, *splits, len(ids)]
        return tuple(tuple(ids[a:b]) for a, b in itertools.pairwise(bounds) if b > a)

    def _prompt(
        self,
        schema: str,
        state: str,
        instructions: str | None,
        earlier: tuple[EarlierAnswer, ...],
        reply: str,
    ) -> tuple[tuple[int, ...], ...]:
        """The prompt ids in cacheable segments: template head, instructions, then schema and request
        in the layout's order."""
        head = f"{instructions}\n\n" if instructions else ""
        request = f"Input:\n{state}\n"
        if earlier:
            request += "\nEarlier answers:\n" + "".join(f"- {heading(a.question)} {a.answer}\n" for a in earlier)
        if self.layout == "schema_first":
            parts = [head, schema + "\n\n", request + "\n" + reply]
        else:
            parts = [head, request + "\n", schema + "\n\n" + reply]
        content = "".join(parts)
        text = self._template(content)
        start = text.find(content)
        if start < 0:
            raise ValueError("the chat template changed the message text; slotread cannot find its segments")
        return self._segments(text, [start, start + len(parts[0]), start + len(parts[0]) + len(parts[1])])

    def _causal_canvas(self, labels: LabelSet) -> tuple[tuple[int, ...], tuple[Slot, ...]]:
        canvas = self._encode(REPLY_PREFIX + labels.lead)
        return (*canvas, labels.ids[0]), (Slot(len(canvas), labels.ids),)

    def _diffusion_canvas(self, lines: list[tuple[str, LabelSet]]) -> tuple[tuple[int, ...], tuple[Slot, ...]]:
        """One line per slot (text before the slot, its labels), then <turn|> and pad to the bucket."""
        canvas: list[int] = []
        slots = []
        for index, (before, labels) in enumerate(lines):
            if index:
                canvas += self._encode("\n")
            canvas += self._encode(before + labels.lead)
            slots.append(Slot(len(canvas), labels.ids))
            canvas.append(labels.ids[0])
        canvas += self._encode(TURN_END)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise ValueError("the tokenizer has no pad token, which DiffusionGemma canvases need")
        canvas += [pad] * (-len(canvas) % CANVAS_BUCKET)
        return tuple(canvas), tuple(slots)

    def render_branch(
        self,
        question: QuestionText,
        state: str,
        instructions: str | None = None,
        earlier: tuple[EarlierAnswer, ...] = (),
    ) -> Rendered:
        """One question alone in its own prompt and canvas (the isolated read)."""
        prompt = self._prompt(question_block(question), state, instructions, earlier, reply_instruction(question))
        if self.family == "diffusion":
            canvas, slots = self._diffusion_canvas([(REPLY_PREFIX, question.labels)])
        else:
            canvas, slots = self._causal_canvas(question.labels)
        return Rendered(prompt, canvas, slots)

    def render_joint(
        self,
        questions: tuple[QuestionText, ...],
        state: str,
        instructions: str | None = None,
        earlier: tuple[EarlierAnswer, ...] = (),
    ) -> Rendered:
        """Several questions numbered in one prompt, one slot each in one canvas (DiffusionGemma)."""
        if self.family != "diffusion":
            raise ValueError("joint canvases need a diffusion model; causal models read one branch per question")
        schema = "\n\n".join(f"{n}. {question_block(q)}" for n, q in enumerate(questions, 1))
        reply = "\n".join(f"{n}. {reply_instruction(q)}" for n, q in enumerate(questions, 1))
        reply = "Answer every question, one line each, as '<number>: <answer>':\n" + reply
        prompt = self._prompt(schema, state, instructions, earlier, reply)
        canvas, slots = self._diffusion_canvas([(f"{n}:", q.labels) for n, q in enumerate(questions, 1)])
        return Rendered(prompt, canvas, slots)
