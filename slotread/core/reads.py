"""A stage's reads: render one read unit per canvas and assignment, read them, aggregate their reads.

The pieces ``slotread.pipeline`` calls for each stage of a decision, in this order: ``render_units``,
``read_units``, ``aggregate_units`` (and ``read_each``, the same for many one-stage decisions at once).

Isolated reads (the default) give each question its own prompt and canvas, so adding, removing,
renaming or reordering other questions cannot move its answer: its noise seeds come from the request
seed and its own token ids, never from its id or position. ``joint`` packs the questions of a stage
into one canvas instead, on models that read every slot of a canvas at once (diffusion and masked):
a question marked ``alone`` keeps a canvas of its own, and ``chunk_rows`` splits the others into
canvases of bounded width (``_groups``).

With ``permutations = k`` a question is read under up to k option→label assignments (cyclic shifts,
``core.assignments``), each its own read; every read's label logits are put back in option order and
the answer is the mean over all reads (draws × assignments). A noul has two assignments (the second
swaps what Yes and No mean, and its prompt says so). A score has one: its labels are the level
numbers, so relabelling would contradict the prompt's "answer with the number of the level".
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, replace

import numpy as np

from slotread.core.aggregate import aggregate_reads, softmax
from slotread.core.answers import Answer, Read
from slotread.core.assignments import listing_order, shifts, to_option_order
from slotread.core.images import PlacedImages, place_images
from slotread.core.questions import Decision, Question
from slotread.engines.base import Engine, ReadRequest, SlotScores, vision_of
from slotread.errors import EngineFault, PromptTooLong
from slotread.prompt.render import EarlierAnswer, OptionText, QuestionText, Rendered, Renderer


@dataclass
class Unit:
    """One rendered read (a branch or a joint canvas), the questions of its slots with the shift each was
    listed under (None: a joint canvas read more often than this question has assignments; not
    counted for it), and its draws; with ``think``, the thought they follow and its length in tokens."""

    rendered: Rendered
    questions: tuple[Question, ...]
    shifts: tuple[int | None, ...]
    scores: list[SlotScores]
    thought: str | None = None
    thought_tokens: int = 0


def token_limit(engine: Engine, max_tokens: int | None) -> int:
    """The most tokens a read may hold: the engine's own limit, or ``max_tokens`` where that is lower."""
    return min(engine.max_tokens, max_tokens or engine.max_tokens)


def question_shifts(question: Question, permutations: int) -> tuple[int, ...]:
    """The assignments (cyclic shifts) a question is read under: one for a score, see the module docstring."""
    return (0,) if question.kind == "score" else shifts(len(question.options), permutations)


def question_text(question: Question, renderer: Renderer, shift: int = 0) -> QuestionText:
    """The model-facing text of a question, options listed under ``shift``, with this tokenizer's labels."""
    alphabet = renderer.alphabet
    n = len(question.options)
    labels = {"noul": alphabet.yes_no, "choice": alphabet.choice(n), "score": alphabet.score(n)}[question.kind]
    listed = [question.options[i] for i in listing_order(n, shift)]
    options = tuple(OptionText(o.name, o.description) for o in listed)
    return QuestionText(question.kind, question.instructions, options, labels, question.kind == "noul" and shift == 1)


def _answer_text(answer: Answer | None) -> str:
    """How an earlier answer reads in a later prompt."""
    if answer is None:
        return "(not asked)"
    option = answer.question.options[answer.top]
    if answer.question.kind == "noul":
        return "Yes" if answer.top == 0 else "No"
    if answer.question.kind == "score":
        return f"{option.name}" + (f" ({option.description})" if option.description else "")
    return option.name


def _earlier(
    group: tuple[Question, ...], decision: Decision, answers: dict[str, Answer | None], renderer: Renderer
) -> tuple[EarlierAnswer, ...]:
    """The earlier answers the group's questions depend on, in request order; unasked ones say so."""
    wanted = {p for q in group for p in q.depends_on}
    return tuple(
        EarlierAnswer(question_text(q, renderer), _answer_text(answers[q.id]))
        for q in decision.questions
        if q.id in wanted
    )


def _seed(request_seed: int, draw: int, rendered: Rendered) -> int:
    """A noise seed from the request seed, the draw index and the read's own token ids."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{request_seed}:{draw}:".encode())
    for segment in rendered.prompt:
        digest.update(_int64_bytes(segment))
    digest.update(_int64_bytes(rendered.canvas))
    return int.from_bytes(digest.digest(), "little") >> 1


@functools.lru_cache(maxsize=1024)
def _int64_bytes(ids: tuple[int, ...]) -> bytes:
    """``ids`` as little-endian int64 bytes, remembered: a request's instructions and schema segments
    (~1,500 ids) recur in every read (``struct`` packs twice as fast as numpy)."""
    return struct.pack(f"<{len(ids)}q", *ids)


def _chunks(questions: tuple[Question, ...], decision: Decision, renderer: Renderer) -> list[tuple[Question, ...]]:
    """``questions`` split in order into the fewest joint canvases of at most ``chunk_rows`` tokens (a
    question too wide for the limit gets a canvas of its own)."""
    if decision.chunk_rows is None or not questions:
        return [questions] if questions else []
    texts = tuple(question_text(q, renderer) for q in questions)
    shared = decision.chunk_prompt == "shared"
    chunks: list[tuple[Question, ...]] = []
    start = 0
    for end in range(1, len(questions) + 1):
        read = tuple(range(start, end))
        rows = renderer.joint_rows(texts, read) if shared else renderer.joint_rows(texts[start:end])
        if end - start > 1 and rows > decision.chunk_rows:
            chunks.append(questions[start : end - 1])
            start = end - 1
    chunks.append(questions[start:])
    return chunks


def _groups(
    asked: tuple[Question, ...], decision: Decision, renderer: Renderer
) -> list[tuple[tuple[Question, ...], tuple[Question, ...]]]:
    """The canvases of one stage as (the questions its prompt lists, those it has slots for): a branch per
    question, or, reading jointly, a branch per question marked ``alone`` and the others in chunks whose
    prompts list the chunk's questions or, with ``chunk_prompt="shared"``, all of them."""
    # a question with solved examples is read alone: its examples are its own (the api refuses the mix)
    joint = decision.joint and renderer.joint and not any(q.examples for q in asked)
    if not joint:
        return [((q,), (q,)) for q in asked]
    together = tuple(q for q in asked if not q.alone)
    shared = decision.chunk_prompt == "shared"
    chunks = [(together if shared else chunk, chunk) for chunk in _chunks(together, decision, renderer)]
    return [((q,), (q,)) for q in asked if q.alone] + chunks


def place(decision: Decision, engine: Engine, renderer: Renderer) -> PlacedImages | None:
    """The decision's images prepared by the engine's image reader (None without images); an engine
    that reads text only is a ValueError (the pipeline refuses such requests first, naming the model)."""
    if not decision.images:
        return None
    vision = vision_of(engine)
    if vision is None:
        raise ValueError("this engine reads text only; the decision has images")
    return place_images(decision.state, decision.images, vision, renderer)


def render_units(
    asked: tuple[Question, ...],
    decision: Decision,
    answers: dict[str, Answer | None],
    renderer: Renderer,
    limit: int,
    images: PlacedImages | None = None,
) -> list[Unit]:
    """The reads of one stage: per canvas (``_groups``) and assignment one read; with ``images``, the
    state marked where they sit and their ids spliced in."""
    state = decision.state if images is None else images.state
    units = []
    for listed, group in _groups(asked, decision, renderer):
        earlier = _earlier(listed, decision, answers, renderer)
        assignments = [question_shifts(q, decision.permutations) for q in listed]
        ids = [q.id for q in listed]
        read = tuple(ids.index(q.id) for q in group)
        for j in range(max(len(assignments[i]) for i in read)):
            shifted = tuple(a[j] if j < len(a) else None for a in assignments)
            texts = tuple(question_text(q, renderer, shift or 0) for q, shift in zip(listed, shifted, strict=True))
            if len(listed) == 1:
                rendered = renderer.render_branch(texts[0], state, decision.instructions, earlier, listed[0].examples)
            else:
                subset = read if len(read) < len(listed) else None
                rendered = renderer.render_joint(texts, state, decision.instructions, earlier, subset)
            if images is not None:
                rendered = images.splice(rendered)
            if rendered.tokens > limit:
                raise PromptTooLong(rendered.tokens, limit)
            units.append(Unit(rendered, group, tuple(shifted[i] for i in read), []))
    return units


def read_units(
    engine: Engine, units: list[Unit], seed: int, draws: range, hidden: bool = False, steps: int = 1
) -> None:
    """Read ``draws`` for every unit in one engine call (``steps`` denoise steps each) and append the scores
    to each unit."""
    requests: list[ReadRequest] = [
        replace(u.rendered.with_seed(_seed(seed, d, u.rendered), hidden), steps=steps) for u in units for d in draws
    ]
    scores = engine.read(requests)
    for index, unit in enumerate(units):
        unit.scores += scores[index * len(draws) : (index + 1) * len(draws)]


def aggregate_units(units: list[Unit]) -> list[Answer]:
    """Every question's reads, from every unit that counts it, in option order; then the answers."""
    reads: dict[str, list[Read]] = {}
    questions: dict[str, Question] = {}
    thoughts: dict[str, str | None] = {}
    for unit in units:
        for slot, (question, shift) in enumerate(zip(unit.questions, unit.shifts, strict=True)):
            if shift is None:
                continue
            questions[question.id] = question
            thoughts.setdefault(question.id, unit.thought)
            reads.setdefault(question.id, []).extend(
                Read(
                    shift,
                    to_option_order(s.logits[slot], shift),
                    s.label_mass[slot],
                    None if s.hidden is None else s.hidden[slot],
                )
                for s in unit.scores
            )
    answers = []
    for qid, question_reads in reads.items():
        logits = np.stack([read.logits for read in question_reads])
        if not np.isfinite(logits).all():
            raise EngineFault(f"the engine returned non-finite label logits for question {qid!r} (NaN or infinity)")
        per_read = softmax(logits)
        answers.append(Answer(questions[qid], aggregate_reads(per_read), tuple(question_reads), thought=thoughts[qid]))
    return answers


def read_each(
    decisions: list[Decision], engine: Engine, renderer: Renderer, max_tokens: int | None = None
) -> list[list[Answer]]:
    """The raw answers of many one-stage decisions (no ``depends_on`` or ``ask_if``, a number of
    samples), read in one engine call, so the engine batches them (``slotread fit`` reads its training
    items so). Each decision's answers are the raw ones ``pipeline.read_stages`` gives it.
    """
    limit = token_limit(engine, max_tokens)
    units: list[list[Unit]] = []
    requests: list[ReadRequest] = []
    for decision in decisions:
        if decision.samples == "auto" or any(q.prerequisites for q in decision.questions):
            raise ValueError("read_each reads one-stage decisions with a number of samples")
        draws = int(decision.samples) if engine.noisy else 1
        units.append(render_units(decision.questions, decision, {}, renderer, limit))
        requests += [
            u.rendered.with_seed(_seed(decision.seed, d, u.rendered), decision.readout)
            for u in units[-1]
            for d in range(draws)
        ]
    scores = iter(engine.read(requests))
    for decision, decision_units in zip(decisions, units, strict=True):
        draws = int(decision.samples) if engine.noisy else 1
        for unit in decision_units:
            unit.scores += [next(scores) for _ in range(draws)]
    return [aggregate_units(decision_units) for decision_units in units]
