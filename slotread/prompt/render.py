"""Render questions through the model's own chat template into token ids, slots and label ids.

A prompt is cut into segments an engine may cache the KV of (template head, request instructions,
then the schema and the request in the family's fixed layout, see ``LAYOUTS``):

    causal, state first:      [head] [instructions] [state, earlier answers]
                              [question + options, reply instruction, template tail] | canvas: <slot>
    diffusion, schema first:  [head] [instructions] [question + options]
                              [Input: state, earlier answers, reply instruction, template tail,
                               empty thought block] | canvas: Answer: <slot> <turn|> pad...
    masked, state first:      [head] [instructions] [state, earlier answers]
                              [question + options, reply instruction, template tail]
                              | canvas: Answer: <slot> <reply end>

Solved examples (``SolvedExample``, retrieved from an example bank by ``slotread.quality.examples``)
put the schema first in every family: the labels an example answers with mean nothing before the
options are listed, and the schema stays a prefix shared by every state. The examples, nearest last,
then the state, share the request's last segment:

    with examples:            [head] [instructions] [question + options]
                              [Solved examples: Input/Answer pairs, Input: state, earlier answers,
                               reply instruction, template tail] | canvas as above

A causal model reads the slot as the first token of its reply; the questions of one decision are
branches sharing the state's KV. DiffusionGemma reads every slot of a fixed-length canvas in one
decoder step, and one question's schema is a prefix shared by every state it is asked about. A joint
canvas (DiffusionGemma and masked models) numbers the questions in one prompt and puts one
"n: <slot>" line per question in the canvas.

A masked model (BERT family, ModernBERT, LLaDA, Dream) reads its canvas like DiffusionGemma, all
slots at once, but with the mask token at each slot and the whole sequence in one forward. Without a
chat template (BERT's tokenizers have none) the prompt is plain text between the special tokens the
tokenizer puts around a sequence: "[CLS] ... Answer: <slot> [SEP]". After the slot comes what ends a
reply: the chat template's end of an assistant turn, or those closing special tokens.

Why the causal prompt looks as it does: small chat models are very sensitive to it. Measured with
qwen2.5-coder-1.5b-instruct (bf16, CPU) on 40 clearly polar SST-5 reviews as a yes/no read, the
question before the review scored 67.5% (a strong "Yes" bias), after it 87.5%; a "Question:" label
on the question 55%, none 85%; the review under an "Input:" label 75%, bare 87.5%; the slot after
"Answer:" 82.5%, as the first token of the reply 87.5%. The same variants on 40 BoolQ passages
moved between 60% and 72.5%.

This module knows text and tokenizers, not wire formats or engines' internals.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal, TypeVar

from transformers import PreTrainedTokenizerBase

from slotread.engines.base import Family, ImageInput, ReadRequest, Slot
from slotread.prompt.labels import Alphabet, LabelSet, build_alphabet

#: The reply text before the slot. A causal model's slot is the first token of its reply (measured, see
#: the module docstring). DiffusionGemma and masked canvases keep "Answer:" so that joint canvases
#: ("1: A", "2: Yes") and single ones read alike (no real diffusion or masked weights here to measure).
REPLY_PREFIX: dict[Family, str] = {"causal": "", "diffusion": "Answer:", "masked": "Answer:"}
#: DiffusionGemma's empty thought block, placed after the generation prompt, outside the canvas.
THOUGHT_BLOCK = "<|channel>thought\n<channel|>"
TURN_END = "<turn|>"
#: DiffusionGemma canvases come in multiples of this many tokens, so most reads share one shape.
CANVAS_BUCKET = 16

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")
QuestionKind = Literal["noul", "choice", "score"]
Layout = Literal["schema_first", "state_first"]
#: The prompt layout per family, fixed because the layout changes answers. Causal: the question after
#: the state, because small chat models answer what they read last (20 points better, see the module
#: docstring), which outweighs caching the schema; the branches of one decision still share the
#: state's KV. DiffusionGemma reads bidirectionally: schema first, so one schema's KV serves every
#: state it is asked about. Masked: no prefix KV can be shared (a bidirectional prefix's hidden states
#: depend on what follows), so caching does not decide; the question goes after the state, next to the
#: slot, where ModernBERT's local layers (a 128-token window) still see it beside a long state.
LAYOUTS: dict[Family, Layout] = {"causal": "state_first", "diffusion": "schema_first", "masked": "state_first"}
#: Marks where a reply goes when finding what the chat template puts after one.
_REPLY_MARK = "SLOTREAD-REPLY"
#: Characters each side of a cut that ``Renderer._joins`` tokenises to check it (tokens are a few
#: characters). Gemma's tokenizer keeps "\n\n" a token of its own, so its cuts always join; byte-level
#: BPE (SmolLM2, Qwen) splits "\n\n" by what follows it, so the causal prompts are tokenised whole.
_JOIN_CHARS = 32
#: Prompt pieces whose ids a renderer keeps (instructions and schemas recur; states mostly do not).
_PIECES_KEPT = 4096


@dataclass(frozen=True)
class OptionText:
    """An option as the model sees it: its name and optional description."""

    name: str
    description: str | None


@dataclass(frozen=True)
class QuestionText:
    """A question as the model sees it: no id, just its text, options and labels.

    ``options`` are in listing order: ``options[i]`` is read through ``labels.texts[i]``. A noul
    lists yes then no, unless ``swapped``: then "Yes" stands for the no option and "No" for yes, and
    the prompt says so (an option-order permutation of a yes/no question).
    """

    kind: QuestionKind
    instructions: str | None
    options: tuple[OptionText, ...]
    labels: LabelSet
    swapped: bool = False


@dataclass(frozen=True)
class SolvedExample:
    """A labelled state shown in the prompt as a solved case: its text and the name of its option."""

    state: str
    answer: str


@dataclass(frozen=True)
class EarlierAnswer:
    """An answer from an earlier stage that a later question sees."""

    question: QuestionText
    answer: str


@dataclass(frozen=True)
class Rendered:
    """A read without its seed: prompt segments, canvas, slots (in question order), and the images whose
    handles the prompt holds (``core.images``)."""

    prompt: tuple[tuple[int, ...], ...]
    canvas: tuple[int, ...]
    slots: tuple[Slot, ...]
    images: tuple[ImageInput, ...] = ()

    def with_seed(self, seed: int, hidden: bool = False) -> ReadRequest:
        """The engine request for one noise draw (``hidden``: with the slots' hidden states)."""
        return ReadRequest(self.prompt, self.canvas, self.slots, seed, hidden, self.images)

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
    lines = [heading(question)]
    if question.kind == "noul":
        lines += [
            f'"{label}" means: {option.description}'
            for label, option in zip(question.labels.texts, question.options, strict=True)
            if option.description
        ]
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
    if question.kind == "noul" and question.swapped:
        return "The answer words are swapped here: answer No if the answer is yes, and Yes if the answer is no."
    if question.kind == "noul":
        return "Answer Yes or No."
    if question.kind == "choice":
        return "Answer with the label of the best option."
    return f"Answer with the number of the level (0-{len(question.options) - 1})."


def examples_block(question: QuestionText, examples: tuple[SolvedExample, ...]) -> str:
    """The solved examples as the model sees them: each state under "Input:", then "Answer:" and the
    label its option is read through in this listing (the answer format the read itself asks for)."""
    names = [option.name for option in question.options]
    cases = [f"Input:\n{e.state}\nAnswer: {question.labels.texts[names.index(e.answer)]}" for e in examples]
    return "Solved examples:\n\n" + "\n\n".join(cases)


class Renderer:
    """Turns question texts into engine reads for one tokenizer and model family.

    Builds and verifies the tokenizer's label alphabet in the reply context at construction. A masked
    model's tokenizer may lack a chat template (plain text between its special tokens); the other
    families need one.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, family: Family, layout: Layout | None = None) -> None:
        self._chat = bool(getattr(tokenizer, "chat_template", None))
        if not self._chat and family != "masked":
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.family = family
        self._backend = tokenizer.backend_tokenizer if tokenizer.is_fast else None
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # ``_piece``: text -> ids
        self._joined: OrderedDict[tuple[str, str], bool] = OrderedDict()  # ``_joins``: (left, right) -> ok
        self.layout: Layout = layout or LAYOUTS[family]
        # what closes the canvas after the slot; a plain prompt opens with the tokenizer's own [CLS]
        self._opening = ""
        if family == "causal":
            self._after_slot = ""
        elif family == "diffusion":
            self._after_slot = TURN_END
        elif self._chat:
            self._after_slot = self._reply_end()
        else:
            self._opening, self._after_slot = _special_ends(tokenizer)
        self.reply_prefix = REPLY_PREFIX[family]
        # the label context: what precedes the slot in a causal read, or the canvas alone otherwise
        prefix = self._template("Question?") + self.reply_prefix if family == "causal" else self.reply_prefix
        self.alphabet: Alphabet = build_alphabet(tokenizer, prefix, self._after_slot)

    @property
    def joint(self) -> bool:
        """Whether questions can share a canvas (``render_joint``): families that read all slots at once."""
        return self.family != "causal"

    def _template(self, content: str) -> str:
        if not self._chat:  # the plain masked-LM prompt; the canvas follows on the next line
            return f"{self._opening}{content}\n"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text + (THOUGHT_BLOCK if self.family == "diffusion" else "")

    def _reply_end(self) -> str:
        """What the chat template puts after an assistant reply (its end-of-turn token), stripped."""
        messages = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": _REPLY_MARK}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        assert isinstance(text, str)
        if _REPLY_MARK not in text:
            raise ValueError("the chat template drops the assistant's reply; slotread cannot find where a reply ends")
        return text[text.rindex(_REPLY_MARK) + len(_REPLY_MARK) :].strip()

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:  # the Rust tokenizer itself: a fifth of the cost of the wrapper's encode
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _segments(self, text: str, cuts: list[int], inner: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
        """Tokenise ``text`` and split the ids where the character offsets ``cuts`` fall, as tokenising it
        whole would (a token straddling a cut goes to the later segment).

        Each piece between cuts is tokenised alone and its ids kept (``_piece``): the instructions and
        schemas that many requests share are tokenised once, not with every prompt (1,500 tokens of
        instructions cost ~2 ms a prompt on these CPUs, held under the GIL by every decision thread).
        The pieces' ids are those of the whole text where no token straddles a cut, which ``_joins``
        checks on the text around each cut; elsewhere the text is tokenised whole. ``inner`` cuts split
        the tokenising, not the segments: the pieces on both sides of one that ``_joins`` refuses are
        tokenised together.
        """
        bounds = sorted({0, *cuts, *inner, len(text)})
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        joins = [self._joins(left[-_JOIN_CHARS:], right[:_JOIN_CHARS]) for left, right in itertools.pairwise(pieces)]
        outer = set(cuts)
        if all(joined for cut, joined in zip(bounds[1:-1], joins, strict=True) if cut in outer):
            segments: list[list[tuple[int, ...]]] = [[]]  # each segment's pieces' ids
            run = pieces[0]
            for cut, joined, piece in zip(bounds[1:-1], joins, pieces[1:], strict=True):
                if not joined:  # an inner cut a token straddles: tokenised with what follows it
                    run += piece
                    continue
                segments[-1].append(self._piece(run))
                run = piece
                if cut in outer:
                    segments.append([])
            segments[-1].append(self._piece(run))
            # a segment of one piece is the kept tuple itself
            ids = (parts[0] if len(parts) == 1 else tuple(itertools.chain.from_iterable(parts)) for parts in segments)
            return tuple(segment for segment in ids if segment)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        whole: list[int] = encoding["input_ids"]
        offsets: list[tuple[int, int]] = encoding["offset_mapping"]
        splits = [next((i for i, (_, end) in enumerate(offsets) if end > cut), len(whole)) for cut in cuts]
        ends = [0, *splits, len(whole)]
        return tuple(tuple(whole[a:b]) for a, b in itertools.pairwise(ends) if b > a)

    def _piece(self, text: str) -> tuple[int, ...]:
        """The ids of ``text`` tokenised alone, remembered for the next prompt that holds it."""
        return _remembered(self._pieces, text, lambda: tuple(self._encode(text)))

    def _joins(self, left: str, right: str) -> bool:
        """Whether ``left + right`` tokenises as ``left`` then ``right`` (no token straddles the join)."""
        if not left or not right:
            return True
        # the two sides recur (a schema's end, a state's start read with each question): their ids are kept
        return _remembered(
            self._joined, (left, right), lambda: self._encode(left + right) == [*self._piece(left), *self._piece(right)]
        )

    def _prompt(
        self,
        schema: str,
        state: str,
        instructions: str | None,
        earlier: tuple[EarlierAnswer, ...],
        reply: str,
        examples: str = "",
    ) -> tuple[tuple[int, ...], ...]:
        """The prompt ids in cacheable segments: template head, instructions, then schema and request
        in the layout's order (schema first whenever there are ``examples``, see the module docstring)."""
        head = f"{instructions}\n\n" if instructions else ""
        layout: Layout = "schema_first" if examples else self.layout
        # A state-first prompt opens with the bare state (measured better); after a schema the state
        # needs a label to mark where it starts.
        request = state + "\n" if layout == "state_first" else f"Input:\n{state}\n"
        if earlier:
            request += "\nEarlier answers:\n" + "".join(f"- {heading(a.question)} {a.answer}\n" for a in earlier)
        shown = examples + "\n\n" if examples else ""
        if layout == "schema_first":
            parts = [head, schema + "\n\n", shown + request + "\n" + reply]
        else:
            parts = [head, request + "\n", schema + "\n" + reply]
        content = "".join(parts)
        text = self._template(content)
        start = text.find(content)
        if start < 0:
            raise ValueError("the chat template changed the message text; slotread cannot find its segments")
        last = start + len(parts[0]) + len(parts[1])
        inner: tuple[int, ...] = ()
        if layout == "schema_first":
            # The last segment holds the state between per-question text (examples, earlier answers, the
            # reply instruction): cut around it, so that a decision tokenises its state once, not with
            # every question, and each cut's join text is shared by its questions or by every request.
            state_start = last + len(shown) + len("Input:\n")
            state_end = state_start + len(state)  # then "\n\n": a blank line before what follows
            inner = (last + len(shown), state_start, state_end, state_end + 2)
        return self._segments(text, [start, start + len(parts[0]), last], inner)

    def _causal_canvas(self, labels: LabelSet) -> tuple[tuple[int, ...], tuple[Slot, ...]]:
        canvas = self._piece(self.reply_prefix + labels.lead)
        return (*canvas, labels.ids[0]), (Slot(len(canvas), labels.ids),)

    def _slot_lines(self, lines: list[tuple[str, LabelSet]]) -> tuple[list[int], tuple[Slot, ...]]:
        """One line per slot (text before the slot, its labels), then the reply end (<turn|>)."""
        canvas: list[int] = []
        slots = []
        for index, (before, labels) in enumerate(lines):
            if index:
                canvas += self._piece("\n")
            canvas += self._piece(before + labels.lead)
            slots.append(Slot(len(canvas), labels.ids))
            canvas.append(labels.ids[0])
        canvas += self._piece(self._after_slot)
        return canvas, tuple(slots)

    def _slot_canvas(self, lines: list[tuple[str, LabelSet]]) -> tuple[tuple[int, ...], tuple[Slot, ...]]:
        """The slot lines, padded to the bucket on DiffusionGemma."""
        canvas, slots = self._slot_lines(lines)
        if self.family != "diffusion":
            return tuple(canvas), tuple(slots)
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
        examples: tuple[SolvedExample, ...] = (),
    ) -> Rendered:
        """One question alone in its own prompt and canvas (the isolated read), after its solved
        ``examples`` (option names of ``question``) when there are any."""
        shown = examples_block(question, examples) if examples else ""
        prompt = self._prompt(
            question_block(question), state, instructions, earlier, reply_instruction(question), shown
        )
        if self.family != "causal":
            canvas, slots = self._slot_canvas([(self.reply_prefix, question.labels)])
        else:
            canvas, slots = self._causal_canvas(question.labels)
        return Rendered(prompt, canvas, slots)

    def render_joint(
        self,
        questions: tuple[QuestionText, ...],
        state: str,
        instructions: str | None = None,
        earlier: tuple[EarlierAnswer, ...] = (),
        read: tuple[int, ...] | None = None,
    ) -> Rendered:
        """Several questions numbered in one prompt, one slot each in one canvas (diffusion and masked).

        ``read``: the indexes of the questions the canvas has slots for (default all); the prompt still
        lists every question, so chunks of one stage can share its schema segment.
        """
        if not self.joint:
            raise ValueError(
                "joint canvases need a diffusion or masked model; causal models read one branch per question"
            )
        read = tuple(range(len(questions))) if read is None else read
        schema = "\n\n".join(f"{n}. {question_block(q)}" for n, q in enumerate(questions, 1))
        reply = "\n".join(f"{n + 1}. {reply_instruction(questions[n])}" for n in read)
        asked = "every question" if len(read) == len(questions) else "questions " + ", ".join(str(n + 1) for n in read)
        reply = f"Answer {asked}, one line each, as '<number>: <answer>':\n" + reply
        prompt = self._prompt(schema, state, instructions, earlier, reply)
        canvas, slots = self._slot_canvas(self._joint_lines(questions, read))
        return Rendered(prompt, canvas, slots)

    def joint_rows(self, questions: tuple[QuestionText, ...], read: tuple[int, ...] | None = None) -> int:
        """The tokens of ``render_joint``'s canvas before its padding (what ``chunk_rows`` bounds)."""
        read = tuple(range(len(questions))) if read is None else read
        return len(self._slot_lines(self._joint_lines(questions, read))[0])

    @staticmethod
    def _joint_lines(questions: tuple[QuestionText, ...], read: tuple[int, ...]) -> list[tuple[str, LabelSet]]:
        return [(f"{n + 1}:", questions[n].labels) for n in read]


def _remembered(kept: OrderedDict[Key, Value], key: Key, compute: Callable[[], Value]) -> Value:
    """``kept[key]``, computed now if absent; the ``_PIECES_KEPT`` most recently used entries are kept."""
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    value = kept[key] = compute()
    if len(kept) > _PIECES_KEPT:
        kept.popitem(last=False)
    return value


def _special_ends(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """The special tokens the tokenizer puts before and after a sequence, as text ("[CLS]", "[SEP]" for
    BERT; empty for most chat tokenizers)."""
    bare = tokenizer.encode("x", add_special_tokens=False)
    full = tokenizer.encode("x", add_special_tokens=True)
    start = next((i for i in range(len(full)) if full[i : i + len(bare)] == bare), None)
    if start is None:
        raise ValueError("the tokenizer's special tokens change the text they surround")
    opening, closing = full[:start], full[start + len(bare) :]
    texts = tokenizer.decode(opening), tokenizer.decode(closing)
    assert isinstance(texts[0], str) and isinstance(texts[1], str)
    return texts[0], texts[1]
