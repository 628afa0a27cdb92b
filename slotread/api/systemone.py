"""The System One wire format (Jev's ``/v1/systemone``) ⇄ core values.

``to_decision`` validates a request body and builds a ``core.Decision``; every problem becomes an
``InvalidRequest`` whose ``detail`` items have pydantic's ``loc``/``msg``/``type`` with ``loc``
starting at ``"body"``, as FastAPI reports them. ``to_response`` turns a ``DecisionResult`` into the
response body. Extensions beyond Jev are ``x_``-prefixed; vLLM's ``instructions`` and ``joint``
request fields are accepted with their meaning, and so are the request options of vLLM's
structured-decision example server (``samples``, ``seed``, ``ask``, ``auto_threshold``, ``auto_max``,
``chunk_rows``, ``chunk_prompt``, ``think``, ``steps`` and a question's ``alone``), under its names. Unknown
top-level fields are ignored, as the contract says; an unknown field inside a question is refused
(``QUESTION_FIELDS``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator

from slotread.api.images import (
    DEFAULT_IMAGE_LIMITS,
    ImageLimits,
    WireAsset,
    WireImage,
    listed_images,
    placed_assets,
)
from slotread.api.read_modes import read_modes
from slotread.api.responses import Level
from slotread.api.unknown_fields import unknown_fields
from slotread.core.answers import Answer, DecisionResult, choice_confidence, score_confidence, score_expectation
from slotread.core.images import Image
from slotread.core.questions import (
    AUTO_MAX,
    AUTO_THRESHOLD,
    MAX_STEPS,
    MAX_THOUGHT_TOKENS,
    CalibrationMethod,
    ChunkPrompt,
    Condition,
    Decision,
    Option,
    QualityOptions,
    Question,
)
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.prompt.labels import MAX_CHOICE_OPTIONS, MAX_SCORE_LEVELS

#: A description or instruction: text, or JSON that is shown to the model as JSON.
Description = str | dict[str, Any] | list[Any] | None
AnswerValue = str | StrictBool | StrictInt

DEFAULT_MAX_QUESTIONS = 64
DEFAULT_MAX_SAMPLES = 32
DEFAULT_MAX_PERMUTATIONS = 16
#: Largest x_examples (solved examples shown per question).
MAX_EXAMPLES = 64
#: Narrowest chunk_rows: a joint canvas line is a few tokens (the example server's minimum too).
MIN_CHUNK_ROWS = 8
#: A float field that takes JSON numbers, not strings or booleans.
Number = Annotated[float, Field(strict=True)]
#: ``think``/``x_think`` and ``steps``/``x_steps`` (``api.read_modes``)
ThoughtBudget = Annotated[int, Field(strict=True, ge=0, le=MAX_THOUGHT_TOKENS)]
DenoiseSteps = Annotated[int, Field(strict=True, ge=1, le=MAX_STEPS)]


#: Every field a question object may have besides ``x_``-prefixed ones; ``parse_request`` refuses others.
#: The official client sends ``type``, ``instructions`` and ``criteria``; vLLM's extensions add the rest.
QUESTION_FIELDS = frozenset({"type", "instructions", "criteria", "depends_on", "ask_if", "alone"})


class _WireQuestion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instructions: Description = None
    depends_on: str | list[str] | None = None
    ask_if: dict[str, list[AnswerValue]] | None = None
    #: read in a canvas of its own even when the request reads jointly
    alone: StrictBool = False


class NoulCriteria(BaseModel):
    """What yes and what no mean; both optional."""

    model_config = ConfigDict(extra="forbid")

    true: Description = None
    false: Description = None


class NoulQuestion(_WireQuestion):
    type: Literal["noul"]
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_WireQuestion):
    type: Literal["choice"]
    criteria: dict[str, Description]

    @field_validator("criteria")
    @classmethod
    def _option_count(cls, criteria: dict[str, Description]) -> dict[str, Description]:
        if not 2 <= len(criteria) <= MAX_CHOICE_OPTIONS:
            raise ValueError(f"a choice needs 2 to {MAX_CHOICE_OPTIONS} options, got {len(criteria)}")
        if "" in criteria:
            raise ValueError("option names must not be empty")
        return criteria


class ScoreQuestion(_WireQuestion):
    type: Literal["score"]
    criteria: list[Level]

    @field_validator("criteria", mode="before")
    @classmethod
    def _no_null_level(cls, criteria: Any) -> Any:
        # The legend echoes each level, and System One's schema (and its client) takes no null legend value.
        nulls = [i for i, level in enumerate(criteria) if level is None] if isinstance(criteria, list) else []
        if nulls:
            raise ValueError(f"score levels are text, objects or arrays; level {nulls[0]} is null")
        return criteria

    @field_validator("criteria")
    @classmethod
    def _level_count(cls, criteria: list[Level]) -> list[Level]:
        if not 2 <= len(criteria) <= MAX_SCORE_LEVELS:
            raise ValueError(f"a score needs 2 to {MAX_SCORE_LEVELS} levels, got {len(criteria)}")
        return criteria


WireQuestion = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class ReadOptions(BaseModel):
    """slotread's ``x_`` read options, taken alike by the System One and the OpenAI Decisions routes."""

    x_seed: StrictInt | None = None
    x_samples: StrictInt | Literal["auto"] | None = None
    x_permutations: StrictInt | None = None
    x_calibration: CalibrationMethod | None = None
    x_coverage: StrictFloat | None = None
    x_readout: StrictBool | None = None
    x_examples: StrictInt | None = None
    x_shortlist: StrictInt | None = None
    # read modes (``api.read_modes``); the ranges are in the schema, so the OpenAPI document shows them
    x_think: ThoughtBudget | None = None
    x_thought: StrictBool | None = None
    x_steps: DenoiseSteps | None = None


class SystemOneRequest(ReadOptions):
    """A System One request body. Unknown top-level fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    state: Any = Field(...)
    #: images ahead of the state (the example server's field), and images the state references (the
    #: official client's), see ``api/images.py``
    images: list[str | WireImage] | None = None
    assets: dict[str, WireAsset] | None = None
    questions: dict[str, WireQuestion]
    instructions: Description = None
    joint: StrictBool | None = None
    # vLLM's extensions: the server echoes request_id in its response header and queues by priority
    # (lower first); cache_salt isolates prefix caches between tenants, and the in-process engines'
    # caches are private to this server, so it is checked and otherwise has no effect here.
    request_id: str | None = None
    cache_salt: str | None = None
    priority: StrictInt = 0
    x_joint: StrictBool | None = None
    # the example server's request options, under its names
    seed: StrictInt | None = None
    samples: StrictInt | Literal["auto"] | None = None
    ask: list[str] | None = None
    auto_threshold: Number | None = None
    auto_max: StrictInt | None = None
    chunk_rows: StrictInt | None = None
    chunk_prompt: ChunkPrompt | None = None
    #: a thought budget (false: 0), and denoise steps (``api.read_modes``)
    think: StrictBool | ThoughtBudget | None = None
    steps: DenoiseSteps | None = None

    @field_validator("questions")
    @classmethod
    def _ids(cls, questions: dict[str, WireQuestion]) -> dict[str, WireQuestion]:
        if not questions:
            raise ValueError("at least one question is required")
        if "" in questions:
            raise ValueError("question ids must not be empty")
        return questions


def render_text(value: Description) -> str | None:
    """Strings verbatim, objects and arrays as JSON (never Python repr), null as None."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def render_state(state: Any) -> str:
    """The state as the model sees it: a string verbatim, anything else as JSON."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def _problem(loc: list[str | int], msg: str, kind: str = "value_error") -> ErrorDetail:
    return {"loc": ["body", *loc], "msg": msg, "type": kind}


def _options(wire: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> tuple[Option, ...]:
    if isinstance(wire, NoulQuestion):
        criteria = wire.criteria or NoulCriteria()
        return (Option("yes", render_text(criteria.true)), Option("no", render_text(criteria.false)))
    if isinstance(wire, ChoiceQuestion):
        return tuple(Option(name, render_text(text)) for name, text in wire.criteria.items())
    return tuple(Option(str(i), render_text(level)) for i, level in enumerate(wire.criteria))


def _answer_name(question: Question, value: str | bool | int) -> str | None:
    """The option name an ``ask_if`` value denotes, or None if it denotes none."""
    if question.kind == "noul":
        named = {True: "yes", False: "no", "yes": "yes", "no": "no"}
        return named.get(value) if isinstance(value, bool | str) else None
    if question.kind == "score" and isinstance(value, int) and not isinstance(value, bool):
        return str(value) if 0 <= value < len(question.options) else None
    if question.kind == "score" and isinstance(value, str):
        by_text = {o.description: o.name for o in question.options}
        return by_text.get(value)
    names = {o.name for o in question.options}
    return value if isinstance(value, str) and value in names else None


def _question(
    qid: str, wire: NoulQuestion | ChoiceQuestion | ScoreQuestion, earlier: dict[str, Question]
) -> tuple[Question, list[ErrorDetail]]:
    problems: list[ErrorDetail] = []
    depends = [wire.depends_on] if isinstance(wire.depends_on, str) else list(wire.depends_on or [])
    for index, target in enumerate(depends):
        if target not in earlier:
            msg = f"depends_on names {target!r}, which is not an earlier question of this request"
            problems.append(_problem(["questions", qid, "depends_on", index], msg))
    conditions = []
    for target, values in (wire.ask_if or {}).items():
        if target not in earlier:
            msg = f"ask_if names {target!r}, which is not an earlier question of this request"
            problems.append(_problem(["questions", qid, "ask_if", target], msg))
            continue
        if not values:
            problems.append(_problem(["questions", qid, "ask_if", target], "list at least one answer"))
        names = [_answer_name(earlier[target], v) for v in values]
        for index, (value, name) in enumerate(zip(values, names, strict=True)):
            if name is None:
                msg = f"{value!r} is not an answer of question {target!r}"
                problems.append(_problem(["questions", qid, "ask_if", target, index], msg))
        conditions.append(Condition(target, frozenset(n for n in names if n is not None)))
    question = Question(
        id=qid,
        kind=wire.type,
        instructions=render_text(wire.instructions),
        options=_options(wire),
        depends_on=tuple(dict.fromkeys(depends)),
        ask_if=tuple(conditions),
        alone=wire.alone,
    )
    return question, problems


def parse_request(body: Any) -> SystemOneRequest:
    """Check a request body's shape and its questions' field names; raises InvalidRequest listing every problem."""
    questions = body.get("questions") if isinstance(body, dict) else None
    problems = [
        problem
        for qid, question in (questions.items() if isinstance(questions, dict) else ())
        for problem in unknown_fields(question, QUESTION_FIELDS, ["body", "questions", qid])
    ]
    try:
        request = SystemOneRequest.model_validate(body)
    except ValidationError as exc:
        problems += [_problem(list(e["loc"]), e["msg"], e["type"]) for e in exc.errors(include_url=False)]
    if problems:
        raise InvalidRequest(problems)
    return request


def to_decision(
    request: SystemOneRequest,
    *,
    max_questions: int = DEFAULT_MAX_QUESTIONS,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    max_options: int = MAX_CHOICE_OPTIONS,
    max_permutations: int = DEFAULT_MAX_PERMUTATIONS,
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
    parts: dict[str, bytes] | None = None,
) -> Decision:
    """Check what the shape cannot (limits, references between questions) and build the Decision.

    ``max_options`` may lower the contract's 255 options per choice (a server protecting its latency).
    ``parts``: the files of a multipart body by part name, which ``assets`` entries name.
    """
    problems: list[ErrorDetail] = []
    if len(request.questions) > max_questions:
        msg = f"at most {max_questions} questions per request, got {len(request.questions)}"
        problems.append(_problem(["questions"], msg))
    seed, samples_given = _plain_or_x(request, "seed", problems), _plain_or_x(request, "samples", problems)
    samples = 1 if samples_given is None else samples_given
    field = "samples" if request.samples is not None else "x_samples"
    if samples != "auto" and not 1 <= int(samples) <= max_samples:
        problems.append(_problem([field], f"{field} must be 1..{max_samples} or 'auto', got {samples}"))
    problems += _auto_problems(request, samples, max_samples)
    problems += _server_option_problems(request)
    modes = read_modes(request, problems)
    permutations = 1 if request.x_permutations is None else request.x_permutations
    if not 1 <= permutations <= max_permutations:
        msg = f"x_permutations must be 1..{max_permutations}, got {permutations}"
        problems.append(_problem(["x_permutations"], msg))
    coverage = request.x_coverage
    if coverage is not None and not 0 < coverage < 1:
        problems.append(_problem(["x_coverage"], f"x_coverage must be between 0 and 1 (exclusive), got {coverage}"))
    if coverage is not None and request.x_calibration == "batch":
        msg = (
            "x_coverage needs x_calibration 'none', 'contextual', 'temperature' or 'binned': batch calibration moves "
            "with traffic"
        )
        problems.append(_problem(["x_coverage"], msg))
    problems += _example_problems(request)
    if request.x_readout:
        problems += _readout_problems(request, permutations)
    questions: dict[str, Question] = {}
    for qid, wire in request.questions.items():
        questions[qid], found = _question(qid, wire, questions)
        problems += found
        if isinstance(wire, ChoiceQuestion) and len(wire.criteria) > max_options:
            msg = f"at most {max_options} options per choice here, got {len(wire.criteria)}"
            problems.append(_problem(["questions", qid, "choice", "criteria"], msg))
    asked = _asked(request.ask, questions, problems)
    if problems:
        raise InvalidRequest(problems)
    state, images = _state_images(request, image_limits, parts or {})
    joint = bool(request.x_joint if request.x_joint is not None else request.joint)
    return Decision(
        state=state,
        images=tuple(images),
        questions=asked,
        instructions=render_text(request.instructions),
        seed=0 if seed is None else int(seed),
        samples=samples,
        joint=joint,
        permutations=permutations,
        quality=QualityOptions(
            calibration=request.x_calibration or "none",
            coverage=coverage,
            examples=request.x_examples or 0,
            shortlist=request.x_shortlist or 0,
        ),
        readout=bool(request.x_readout),
        auto_threshold=AUTO_THRESHOLD if request.auto_threshold is None else request.auto_threshold,
        auto_max=request.auto_max or AUTO_MAX,
        chunk_rows=request.chunk_rows,
        chunk_prompt=request.chunk_prompt or "own",
        think=modes.think,
        steps=modes.steps,
    )


def _state_images(request: SystemOneRequest, limits: ImageLimits, parts: dict[str, bytes]) -> tuple[str, list[Image]]:
    """The state text and its decoded images: ``images`` ahead of it, ``assets`` where it references them."""
    listed = listed_images(request.images or [], limits)
    if request.assets is None and parts:
        raise InvalidRequest.at(["body", "assets"], "the multipart body has files but the request names no assets")
    state, placed = (
        placed_assets(request.state, request.assets, parts, limits, len(listed))
        if request.assets is not None
        else (render_state(request.state), [])
    )
    return state, [*listed, *placed]


def _plain_or_x(request: SystemOneRequest, name: str, problems: list[ErrorDetail]) -> Any:
    """The value of ``name`` or ``x_<name>`` (either may be given; both only if equal)."""
    plain, prefixed = getattr(request, name), getattr(request, f"x_{name}")
    if plain is not None and prefixed is not None and plain != prefixed:
        problems.append(_problem([name], f"{name} and x_{name} are the same option: give one, or both equal"))
    return plain if plain is not None else prefixed


def _auto_problems(request: SystemOneRequest, samples: Any, max_samples: int) -> list[ErrorDetail]:
    """auto_threshold and auto_max: their ranges, and that they tune samples 'auto'."""
    problems = []
    threshold, most = request.auto_threshold, request.auto_max
    if threshold is not None and not 0 <= threshold <= 1:
        msg = f"auto_threshold is a normalised entropy, 0..1, got {threshold}"
        problems.append(_problem(["auto_threshold"], msg))
    if most is not None and not 1 <= most <= max_samples:
        problems.append(_problem(["auto_max"], f"auto_max must be 1..{max_samples}, got {most}"))
    for field in ("auto_threshold", "auto_max"):
        if getattr(request, field) is not None and samples != "auto":
            msg = f"{field} tunes samples 'auto' (slotread's default is 1 sample): add samples: 'auto'"
            problems.append(_problem([field], msg))
    return problems


def _server_option_problems(request: SystemOneRequest) -> list[ErrorDetail]:
    """chunk_rows, as far as slotread takes it."""
    problems = []
    if request.chunk_rows is not None and request.chunk_rows < MIN_CHUNK_ROWS:
        msg = f"chunk_rows must be at least {MIN_CHUNK_ROWS} canvas tokens, got {request.chunk_rows}"
        problems.append(_problem(["chunk_rows"], msg))
    return problems


def _asked(ask: list[str] | None, questions: dict[str, Question], problems: list[ErrorDetail]) -> tuple[Question, ...]:
    """The questions ``ask`` names and every question they need answered first, in request order (all
    questions when ``ask`` is absent)."""
    if ask is None:
        return tuple(questions.values())
    if not ask:
        problems.append(_problem(["ask"], "list at least one question id, or leave ask out"))
    wanted: set[str] = set()
    pending = []
    for index, qid in enumerate(ask):
        if qid not in questions:
            problems.append(_problem(["ask", index], f"ask names {qid!r}, which is not a question of this request"))
        else:
            pending.append(qid)
    while pending:
        qid = pending.pop()
        if qid not in wanted and qid in questions:
            wanted.add(qid)
            pending += questions[qid].prerequisites
    return tuple(q for q in questions.values() if q.id in wanted)


def _readout_problems(request: SystemOneRequest, permutations: int) -> list[ErrorDetail]:
    """What ``x_readout`` cannot be combined with: a readout is fitted on one isolated read per draw under
    the listed option order, and is itself calibrated (x_samples averages its answer over the draws)."""
    problems = []
    if permutations > 1:
        problems.append(_problem(["x_permutations"], "x_readout reads each question under one assignment: ask 1"))
    if request.x_calibration not in (None, "none"):
        problems.append(_problem(["x_calibration"], "x_readout answers with a head calibrated in its fit: ask 'none'"))
    if request.x_coverage is not None:
        problems.append(_problem(["x_coverage"], "x_readout has no conformal scores: leave x_coverage out"))
    if request.x_joint or (request.x_joint is None and request.joint):
        problems.append(_problem(["x_joint"], "x_readout reads each question on its own: leave joint reads off"))
    for field in ("x_examples", "x_shortlist"):
        if getattr(request, field):
            problems.append(
                _problem([field], f"x_readout was fitted on reads without examples or shortlists: drop {field}")
            )
    return problems


def _example_problems(request: SystemOneRequest) -> list[ErrorDetail]:
    """x_examples and x_shortlist: their ranges, and the read options they cannot be combined with."""
    problems = []
    examples, shortlist = request.x_examples or 0, request.x_shortlist or 0
    if not 0 <= examples <= MAX_EXAMPLES:
        problems.append(_problem(["x_examples"], f"x_examples must be 0..{MAX_EXAMPLES}, got {examples}"))
    if shortlist and not 2 <= shortlist <= MAX_CHOICE_OPTIONS:
        msg = f"x_shortlist must be 0 (off) or 2..{MAX_CHOICE_OPTIONS}, got {shortlist}"
        problems.append(_problem(["x_shortlist"], msg))
    if not examples and not shortlist:
        return problems
    field = "x_examples" if examples else "x_shortlist"
    if request.x_joint or (request.x_joint is None and request.joint):
        msg = f"{field} reads each question alone (its examples and options are its own); drop joint"
        problems.append(_problem([field], msg))
    if request.x_calibration in ("temperature", "batch", "binned"):
        msg = (
            f"x_calibration {request.x_calibration!r} is fitted on or gathered from reads without examples or "
            f"shortlists; with {field} use 'none' or 'contextual' (its content-free reads show the same "
            "examples and options)"
        )
        problems.append(_problem(["x_calibration"], msg))
    if request.x_coverage is not None:
        msg = f"x_coverage's conformal scores are fitted on reads without examples or shortlists; drop it or {field}"
        problems.append(_problem(["x_coverage"], msg))
    return problems


def _answer(answer: Answer, wire: NoulQuestion | ChoiceQuestion | ScoreQuestion, thought: bool) -> dict[str, Any]:
    question = answer.question
    p = answer.probabilities
    summary = answer.summary
    names = [o.name for o in question.options]
    body: dict[str, Any] = {"type": question.kind}
    if question.kind == "noul":
        body["noul"] = float(p[0])
    elif question.kind == "choice":
        body["choice"] = answer.top_name
        body["probabilities"] = {name: float(v) for name, v in zip(names, p, strict=True)}
        body["confidence"] = choice_confidence(p)
    else:
        body["score"] = score_expectation(p)
        assert isinstance(wire, ScoreQuestion)
        body["legend"] = {name: level for name, level in zip(names, wire.criteria, strict=True)}
        body["probabilities"] = {name: float(v) for name, v in zip(names, p, strict=True)}
        body["confidence"] = score_confidence(p)
    if summary.stderr is not None:
        stderr = summary.stderr
        body["x_stderr"] = (
            float(stderr[0]) if question.kind == "noul" else {n: float(s) for n, s in zip(names, stderr, strict=True)}
        )
        body["x_agreement"] = summary.agreement
    if answer.prediction_set is not None and question.kind != "noul":
        body["x_set"] = [names[i] for i in answer.prediction_set]
    body["x_entropy"] = summary.entropy
    body["x_label_mass"] = answer.label_mass
    body["x_reads"] = summary.reads
    if thought and answer.thought is not None:
        body["x_thought"] = answer.thought
    return body


def to_response(
    result: DecisionResult, request: SystemOneRequest, model: str, deterministic: bool | None = None
) -> dict[str, Any]:
    """The System One response body: answers keyed by id in request order, and integer usage; with
    ``deterministic`` known (an in-process engine), ``x_deterministic``: whether these probabilities are
    bit-identical to what the same request gets alone, in any burst and with any cache state.

    A question not asked (skipped by ``ask_if``, or left out of ``ask``) has no answer: System One answers
    are never null, and its client refuses one. Score legends echo the levels exactly as the request gave them.
    """
    answers = {
        qid: _answer(answer, request.questions[qid], bool(request.x_thought))
        for qid, answer in result.answers.items()
        if answer is not None
    }
    body: dict[str, Any] = {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": int(result.input_tokens), "output_tokens": int(result.output_tokens)},
    }
    if deterministic is not None:
        body["x_deterministic"] = deterministic
    return body
