"""A request's path through the Decider, one named stage after another.

``respond`` (``answer``, then ``assemble``) calls them in this order:

1. ``validate``: the wire body as a core Decision; refused (4xx) when it is malformed, names another
   model, or asks for what this model cannot read (images, thoughts, denoise steps).
2. ``choose_renderer``: the prompt layout the decision's learned readouts were fitted in, else the model's.
3. ``retrieve``: each question's solved examples and shortlisted options from the example banks; they
   change the prompts (and the schemas' content-free reads), so they come before anything is read.
4. ``refuse_missing_fits``: a 422 for every fit the answers will need and the stores lack (calibration,
   conformal scores, readouts), before the engine spends anything on the request.
5. ``read_content_free``: calibration's content-free reads the store lacks (with examples or a
   shortlist, this request's own); every answer is divided by them, so they are read first.
6. ``take_fits``: what the answers are finished with, taken from the stores once (they may change
   while the decision reads).
7. ``read_stages``: per plan stage (``depends_on`` and ``ask_if`` need the finished answers of earlier
   stages, so a stage is read only after the stages before it are finished):
   ``ask`` → ``render_units`` (a prompt per canvas and option assignment; ``think`` writes a thought
   first where asked) → ``read`` (one engine call: the server's batcher merges it with other
   requests') → ``aggregate_units`` (the reads in option order, averaged) → ``finish``
   (``readout_answer``, or ``calibrate`` then ``conformal_set``; then ``expand_answer`` for a
   shortlist).
8. ``assemble``: the response body, typed answers and usage.

The pieces live with what they know: the wire format in ``api``, reading in ``core.reads``, the
fits and their maths in ``quality``; this module only calls them in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import numpy as np

from slotread.api import systemone
from slotread.api.images import ImageLimits
from slotread.api.read_modes import model_problems, read_modes
from slotread.core.answers import Answer, DecisionResult
from slotread.core.plan import is_asked, plan_stages
from slotread.core.questions import Decision, Question
from slotread.core.reads import Unit, aggregate_units, place, read_units, render_units, token_limit
from slotread.core.thinking import think
from slotread.engines.base import Engine
from slotread.engines.remote.engine import RemoteEngine
from slotread.engines.thought import can_think
from slotread.errors import InvalidRequest, UnknownModel
from slotread.models.encoder import SentenceEncoder
from slotread.prompt.render import Layout, Renderer
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.apply import calibrate, conformal_set, refuse_unfitted
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.content_free import (
    blank_decisions,
    learn_content_free,
    mean_by_shift,
    missing_content_free,
)
from slotread.quality.calibration.store import CalibrationStore
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.shortlist import Shortlist, expand_answer
from slotread.quality.examples.shortlist import retrieve as retrieve_examples
from slotread.quality.readouts.apply import readout_answer, refuse_missing_readouts
from slotread.quality.readouts.readout import Readout
from slotread.quality.readouts.store import ReadoutStore

#: Model names a request may give besides the served model's own name.
MODEL_ALIASES = ("jev-latest",)

#: What each raw answer goes through before later stages and the caller see it (``finish``).
Finish = Callable[[Answer], Answer]
#: Content-free distributions by question id: shift → p_cf.
ContentFree = Mapping[str, Mapping[int, np.ndarray]]


class Served(Protocol):
    """What the stages read from the Decider: its model's name, engine and renderers, stores and limits."""

    name: str
    engine: Engine
    renderer: Renderer
    calibrations: CalibrationStore
    banks: ExampleBanks
    readouts: ReadoutStore
    encoder: SentenceEncoder | None
    max_questions: int
    max_samples: int
    max_options: int
    max_permutations: int
    max_prompt_tokens: int | None
    image_limits: ImageLimits

    @property
    def takes_images(self) -> bool: ...

    def renderer_for(self, layout: Layout) -> Renderer: ...


@dataclass(frozen=True)
class Fits:
    """What a decision's raw answers are finished with, by schema (``schemas``: each question's schema by
    question id): calibration artifacts and content-free distributions (``content_free`` by question
    id, read for this request, wins over the store's), learned readouts and their banks, shortlists by
    question id."""

    schemas: Mapping[str, str]
    calibrations: Mapping[str, tuple[Calibration | None, Mapping[int, np.ndarray]]] = field(default_factory=dict)
    content_free: ContentFree = field(default_factory=dict)
    readouts: Mapping[str, tuple[Readout, ExampleBank | None]] = field(default_factory=dict)
    shortlists: Mapping[str, Shortlist] = field(default_factory=dict)


def respond(served: Served, request: dict[str, Any], parts: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The response body to a System One request body (``parts``: a multipart body's files by part name)."""
    wire, result = answer(served, request, parts)
    return assemble(served, wire, result)


def answer(
    served: Served, request: dict[str, Any], parts: dict[str, bytes] | None = None
) -> tuple[systemone.SystemOneRequest, DecisionResult]:
    """The parsed request and its answers as core values: every stage but ``assemble``."""
    wire, decision = validate(served, request, parts)
    renderer = choose_renderer(served, decision)
    decision, shortlists = retrieve(served, decision)
    schemas = {q.id: schema_hash(q, decision.instructions) for q in decision.questions}
    refuse_missing_fits(served, decision, schemas)
    content_free, spent = read_content_free(served, decision, renderer, schemas)
    fits = take_fits(served, decision, schemas, content_free, shortlists)
    finishing = partial(finish, decision=decision, fits=fits, served=served)
    result = read_stages(decision, served.engine, renderer, served.max_prompt_tokens, finishing)
    return wire, DecisionResult(result.answers, result.input_tokens + spent[0], result.output_tokens + spent[1])


def validate(
    served: Served, request: dict[str, Any], parts: dict[str, bytes] | None
) -> tuple[systemone.SystemOneRequest, Decision]:
    """The wire request and its core Decision. Raises InvalidRequest (with FastAPI-style ``detail``) or
    UnknownModel."""
    wire = systemone.parse_request(request)
    if wire.model is not None and wire.model not in (served.name, *MODEL_ALIASES):
        raise UnknownModel(wire.model, [served.name, *MODEL_ALIASES])
    if (wire.images or wire.assets or parts) and not served.takes_images:
        raise _no_images(served)
    decision = systemone.to_decision(
        wire,
        max_questions=served.max_questions,
        max_samples=served.max_samples,
        max_options=served.max_options,
        max_permutations=served.max_permutations,
        image_limits=served.image_limits,
        parts=parts,
    )
    modes = read_modes(wire, [])
    thinks, upstream = can_think(served.engine), isinstance(served.engine, RemoteEngine)
    if unable := model_problems(modes, served.name, served.engine.family, thinks, upstream):
        raise InvalidRequest(unable)
    return wire, decision


def _no_images(served: Served) -> InvalidRequest:
    if isinstance(served.engine, RemoteEngine):
        msg = (
            f"images cannot go through --upstream: slotread sends reads to vLLM's completions API as token ids, "
            f"which carry no images; serve {served.name} in process to ask about images"
        )
    else:
        msg = f"model {served.name!r} reads text only: it takes no images"
    return InvalidRequest.at(["body", "images"], msg, "images_not_supported")


def choose_renderer(served: Served, decision: Decision) -> Renderer:
    """The renderer in the layout the decision's readouts were fitted in, else the model's own. Raises
    InvalidRequest when the readouts' layouts differ."""
    layout = served.readouts.layout_for(decision) if decision.readout else None
    return served.renderer_for(layout) if layout else served.renderer


def retrieve(served: Served, decision: Decision) -> tuple[Decision, dict[str, Shortlist]]:
    """The decision with its questions' solved examples and shortlisted options (``x_examples``,
    ``x_shortlist``) from the banks, or from meaning with a sentence encoder; the shortlists by question
    id. Raises InvalidRequest when no bank serves a question that needs one."""
    embed = served.encoder.embed if served.encoder is not None else None
    return retrieve_examples(decision, served.banks, embed)


def refuse_missing_fits(served: Served, decision: Decision, schemas: Mapping[str, str]) -> None:
    """Raise InvalidRequest when a readout (``x_readout``) or a calibration fit (``x_calibration``,
    ``x_coverage``) the decision needs is missing."""
    if decision.readout:
        refuse_missing_readouts(decision, served.readouts, served.banks, schemas)
    else:
        refuse_unfitted(decision, served.calibrations, schemas)


def read_content_free(
    served: Served, decision: Decision, renderer: Renderer, schemas: Mapping[str, str]
) -> tuple[ContentFree, tuple[int, int]]:
    """For ``contextual`` and ``binned``: the content-free distributions this request needs and the store
    lacks, read; returns those read for this request alone (with examples or a shortlist) by question
    id, and the input and output tokens spent. Those of plain schemas are kept in the store."""
    method = decision.quality.calibration
    if decision.readout or method not in ("contextual", "binned"):
        return {}, (0, 0)
    if method == "contextual" and (decision.quality.examples or decision.quality.shortlist):
        questions = {q.id: _unconditional(q) for q in decision.questions}
        return _read_blank(served, decision, renderer, questions)
    missing = missing_content_free(decision, served.calibrations, schemas)
    if not missing:
        return {}, (0, 0)
    found, spent = _read_blank(served, decision, renderer, missing)
    learn_content_free(served.calibrations, missing, found)
    return {}, spent


def _unconditional(question: Question) -> Question:
    return replace(question, depends_on=(), ask_if=())


def _read_blank(
    served: Served, decision: Decision, renderer: Renderer, questions: Mapping[str, Question]
) -> tuple[dict[str, dict[int, np.ndarray]], tuple[int, int]]:
    """``questions`` (by key) read on every content-free state: per key shift → the mean distribution, and
    the tokens spent."""
    results = [
        read_stages(blank, served.engine, renderer, served.max_prompt_tokens)
        for blank in blank_decisions(decision, questions)
    ]
    found = {key: mean_by_shift(_asked(result.answers[key]) for result in results) for key in questions}
    return found, (sum(r.input_tokens for r in results), sum(r.output_tokens for r in results))


def _asked(answer: Answer | None) -> Answer:
    assert answer is not None  # a content-free read asks every question
    return answer


def take_fits(
    served: Served,
    decision: Decision,
    schemas: Mapping[str, str],
    content_free: ContentFree,
    shortlists: Mapping[str, Shortlist],
) -> Fits:
    """What ``finish`` needs, taken from the stores once: they may forget or learn while the decision reads."""
    if decision.readout:
        readouts: dict[str, tuple[Readout, ExampleBank | None]] = {}
        for schema in schemas.values():
            readout = served.readouts.get(schema)
            assert readout is not None  # refuse_missing_fits refused the decision otherwise
            readouts[schema] = (readout, served.banks.get(schema))
        return Fits(schemas, readouts=readouts)
    store = served.calibrations
    calibrations: dict[str, tuple[Calibration | None, Mapping[int, np.ndarray]]] = {}
    if _calibrates(decision):
        calibrations = {schema: (store.artifact(schema), store.content_free(schema)) for schema in schemas.values()}
    return Fits(schemas, calibrations, content_free, shortlists=shortlists)


def read_stages(
    decision: Decision, engine: Engine, renderer: Renderer, max_tokens: int | None = None, finish: Finish | None = None
) -> DecisionResult:
    """Read every question of ``decision`` stage by stage; ``finish`` turns each raw answer into the one
    that later stages (``ask_if``, ``depends_on``) and the caller see (None: the raw answers).

    Raises PromptTooLong before a stage reads anything if one of its reads exceeds ``max_tokens`` (or
    the engine's own limit).
    """
    limit = token_limit(engine, max_tokens)
    draws = 1 if not engine.noisy or decision.samples == "auto" else int(decision.samples)
    answers: dict[str, Answer | None] = {q.id: None for q in decision.questions}
    images = place(decision, engine, renderer)
    input_tokens = output_tokens = 0
    for stage in plan_stages(decision.questions):
        asked = ask(stage, answers)
        if not asked:
            continue
        units = render_units(asked, decision, answers, renderer, limit, images)
        if decision.think:
            think(units, decision.think, decision.seed, engine, renderer, limit)
        read(engine, units, decision, draws)
        for unit in units:
            input_tokens += unit.rendered.tokens - unit.thought_tokens
            output_tokens += len(unit.questions) * len(unit.scores) + unit.thought_tokens
        for raw in aggregate_units(units):
            answers[raw.question.id] = finish(raw) if finish else raw
    return DecisionResult(answers, input_tokens, output_tokens)


def ask(stage: tuple[Question, ...], answers: Mapping[str, Answer | None]) -> tuple[Question, ...]:
    """The questions of a stage that their ``ask_if`` conditions let through, given earlier answers."""
    return tuple(q for q in stage if is_asked(q, answers))


def read(engine: Engine, units: list[Unit], decision: Decision, draws: int) -> None:
    """Every unit's ``draws`` in one engine call; with ``samples: "auto"`` on a noisy engine, the units of
    questions still uncertain (entropy above ``auto_threshold``) read again up to ``auto_max`` draws."""
    read_units(engine, units, decision.seed, range(draws), decision.readout, decision.steps)
    if decision.samples == "auto" and engine.noisy:
        uncertain = {a.question.id for a in aggregate_units(units) if a.summary.entropy > decision.auto_threshold}
        again = [u for u in units if any(q.id in uncertain for q in u.questions)]
        if again and decision.auto_max > 1:
            read_units(engine, again, decision.seed, range(1, decision.auto_max), decision.readout, decision.steps)


def finish(answer: Answer, decision: Decision, fits: Fits, served: Served) -> Answer:
    """A raw answer as later stages and the caller see it: its readout's answer (``x_readout``); or
    calibrated and given its prediction set (``x_calibration``, ``x_coverage``), then expanded to
    every option where it was read on a shortlist."""
    qid = answer.question.id
    schema = fits.schemas[qid]
    if decision.readout:
        readout, bank = fits.readouts[schema]
        return readout_answer(answer, decision.state, schema, readout, served.readouts, bank)
    if _calibrates(decision):
        fitted, content_free = fits.calibrations[schema]
        content_free = fits.content_free.get(qid, content_free)
        answer = calibrate(answer, decision.quality.calibration, schema, served.calibrations, fitted, content_free)
        answer = conformal_set(answer, decision, fitted)
    return expand_answer(answer, fits.shortlists[qid]) if qid in fits.shortlists else answer


def _calibrates(decision: Decision) -> bool:
    """Whether the decision's answers are calibrated (``x_calibration`` other than none, or ``x_coverage``)."""
    return decision.quality.calibration != "none" or decision.quality.coverage is not None


def assemble(served: Served, wire: systemone.SystemOneRequest, result: DecisionResult) -> dict[str, Any]:
    """The response body: typed answers, usage, and whether the answers are bit-reproducible."""
    deterministic = None
    if not isinstance(served.engine, RemoteEngine):
        # thoughts and multi-step reads sample through the library's own kernels: not batch-invariant
        modes = read_modes(wire, [])
        deterministic = served.engine.deterministic and modes.think == 0 and modes.steps == 1
    return systemone.to_response(result, wire, served.name, deterministic)
