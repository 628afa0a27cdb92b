"""The OpenAI Decisions wire format (``/v1/decisions``) ⇄ the System One body the Decider answers.

Request: ``{model?, input, questions: [...]}``. ``input`` is a string, or a list of user messages
whose ``content`` is a string or a list of ``{"type": "input_text", "text": ...}`` parts (their
texts, joined by blank lines, become the state) and ``{"type": "input_image", "image_url":
"data:image/...;base64,..."}`` parts (also ``image_url: {"url": ...}``): each image sits in the state
where its part is, on models that read images (``api/images.py``). Questions are a list; each has ``type``, an
optional ``name`` (unique when given) and optional ``instructions``:

* ``predicate``: a statement or yes/no question; answered with ``probability`` that it holds;
* ``choice``: 2..255 ``choices`` of ``{value, description?}``, values unique and non-empty;
* ``score``: 2..10 ``levels`` of ``{label, description?}``, low to high; level values are the
  0-based indexes.

Response: ``answers`` is a list in question order, each with ``type``, ``name`` (null when the
question had none) and ``confidence``; probabilities are lists (``[{value, probability}]`` for a
choice, ``[{label, value, probability}]`` for a score). ``usage`` has ``input_tokens``,
``output_tokens`` and ``total_tokens``. Confidence uses System One's formulas; a predicate's is
the two-option choice confidence, |2p − 1|.

Field names follow the issue and the public OpenAI Decisions descriptions we could find
(third-party SDK references: answers as a list with ``name``, score probabilities as
``{label, value, probability}``); no authoritative OpenAI schema was available here, so treat the
less common fields (level ``value``, message parts) as our reading, not a verified contract.
Validation errors are located in this format (``["body", "questions", 2, "choices"]``), never in
the System One body it is converted to.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slotread.api.images import DATA_URL as _DATA_URL
from slotread.api.systemone import ReadOptions
from slotread.api.unknown_fields import unknown_fields
from slotread.core.answers import choice_confidence
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.prompt.labels import MAX_CHOICE_OPTIONS, MAX_SCORE_LEVELS


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    """A text part of a message."""

    type: Literal["input_text", "text"]
    text: str


class ImageUrl(_Wire):
    """The chat form of an image part's URL."""

    url: str


class ImagePart(_Wire):
    """An image part of a message: a ``data:image/...;base64,`` URL (slotread fetches nothing)."""

    type: Literal["input_image", "image_url"]
    image_url: str | ImageUrl

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class UserMessage(_Wire):
    """A user message: a string, or a list of text and image parts."""

    role: Literal["user"]
    content: str | list[ContentPart]


class _Question(_Wire):
    name: str | None = Field(None, min_length=1)
    instructions: str | None = None


class PredicateQuestion(_Question):
    """Does a statement hold?"""

    type: Literal["predicate"]


class ChoiceOption(_Wire):
    """One option of a choice question."""

    value: str = Field(min_length=1)
    description: str | None = None


class ChoiceQuestion(_Question):
    """Which one of the choices?"""

    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=MAX_CHOICE_OPTIONS)

    @field_validator("choices")
    @classmethod
    def _unique_values(cls, choices: list[ChoiceOption]) -> list[ChoiceOption]:
        values = [c.value for c in choices]
        if len(set(values)) != len(values):
            repeated = sorted({v for v in values if values.count(v) > 1})
            raise ValueError(f"choice values must be unique; repeated: {repeated}")
        return choices


class ScoreLevel(_Wire):
    """One level of a score, low to high."""

    label: str
    description: str | None = None


class ScoreQuestion(_Question):
    """Which level, on an ordered scale?"""

    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=MAX_SCORE_LEVELS)


DecisionQuestion = Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionsRequest(_Wire, ReadOptions):
    """An OpenAI Decisions request body; slotread's ``x_`` read options pass through."""

    model: str | None = None
    input: str | list[UserMessage] = Field(min_length=1)
    questions: list[DecisionQuestion] = Field(min_length=1)

    @field_validator("questions")
    @classmethod
    def _unique_names(cls, questions: list[DecisionQuestion]) -> list[DecisionQuestion]:
        names = [q.name for q in questions if q.name is not None]
        if len(set(names)) != len(names):
            raise ValueError("question names must be unique")
        return questions


#: The fields of a question, a choice and a level besides ``x_``-prefixed ones; ``parse_request`` refuses others.
QUESTION_FIELDS = frozenset({"type", "name", "instructions", "choices", "levels"})
CHOICE_FIELDS = frozenset({"value", "description"})
LEVEL_FIELDS = frozenset({"label", "description"})


def _unknown_question_fields(body: Any) -> list[ErrorDetail]:
    questions = body.get("questions") if isinstance(body, dict) else None
    problems = []
    for index, question in enumerate(questions if isinstance(questions, list) else []):
        loc: list[str | int] = ["body", "questions", index]
        problems += unknown_fields(question, QUESTION_FIELDS, loc)
        for field, known in (("choices", CHOICE_FIELDS), ("levels", LEVEL_FIELDS)):
            items = question.get(field) if isinstance(question, dict) else None
            for position, item in enumerate(items if isinstance(items, list) else []):
                problems += unknown_fields(item, known, [*loc, field, position])
    return problems


def parse_request(body: Any) -> DecisionsRequest:
    """Check a request body's shape and its questions' field names; raises InvalidRequest listing every
    problem, located under ``body``."""
    problems = _unknown_question_fields(body)
    try:
        request = DecisionsRequest.model_validate(body)
    except ValidationError as exc:
        problems += [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors(include_url=False)
        ]
    if problems:
        raise InvalidRequest(problems)
    return request


def _state(request: DecisionsRequest) -> tuple[str, dict[str, dict[str, str]]]:
    """The state text, with a reference where each image part was, and the images as System One assets."""
    if isinstance(request.input, str):
        return request.input, {}
    texts, assets = [], {}
    for m, message in enumerate(request.input):
        for p, part in enumerate([message.content] if isinstance(message.content, str) else message.content):
            if isinstance(part, str | TextPart):
                texts.append(part if isinstance(part, str) else part.text)
                continue
            reference = f"<input[{m}].content[{p}]>"
            match = _DATA_URL.fullmatch(part.url)
            if match is None:
                msg = (
                    f"image {reference} must be a data:image/...;base64, URL (slotread fetches no image from elsewhere)"
                )
                raise InvalidRequest.at(["body", "input", m, "content", p, "image_url"], msg)
            texts.append(reference)
            assets[reference] = {"type": "image", "data_base64": match[1]}
    return "\n\n".join(texts), assets


def _criteria(question: PredicateQuestion | ChoiceQuestion | ScoreQuestion) -> dict[str, Any]:
    if isinstance(question, PredicateQuestion):
        return {"type": "noul"}
    if isinstance(question, ChoiceQuestion):
        return {"type": "choice", "criteria": {c.value: c.description for c in question.choices}}
    # A level reads as its label, with its description after it when there is one.
    levels = [level.label + (f": {level.description}" if level.description else "") for level in question.levels]
    return {"type": "score", "criteria": levels}


def to_systemone(request: DecisionsRequest) -> dict[str, Any]:
    """The System One body asking the same questions; question ids are list positions ("0", "1", ...)."""
    state, assets = _state(request)
    body: dict[str, Any] = {
        "state": state,
        "questions": {
            str(index): {**_criteria(question), "instructions": question.instructions}
            for index, question in enumerate(request.questions)
        },
    }
    if request.model is not None:
        body["model"] = request.model
    if assets:
        body["assets"] = assets
    for option in ReadOptions.model_fields:
        if getattr(request, option) is not None:
            body[option] = getattr(request, option)
    return body


def _answer(question: PredicateQuestion | ChoiceQuestion | ScoreQuestion, answer: dict[str, Any]) -> dict[str, Any]:
    extensions = {key: value for key, value in answer.items() if key.startswith("x_")}
    if isinstance(question, PredicateQuestion):
        p = float(answer["noul"])
        body: dict[str, Any] = {"probability": p, "confidence": choice_confidence(np.array([p, 1.0 - p]))}
    elif isinstance(question, ChoiceQuestion):
        probabilities = answer["probabilities"]
        body = {
            "choice": answer["choice"],
            "probabilities": [{"value": c.value, "probability": probabilities[c.value]} for c in question.choices],
            "confidence": answer["confidence"],
        }
    else:
        probabilities = answer["probabilities"]
        body = {
            "score": answer["score"],
            "probabilities": [
                {"label": level.label, "value": index, "probability": probabilities[str(index)]}
                for index, level in enumerate(question.levels)
            ],
            "confidence": answer["confidence"],
        }
    return {"type": question.type, "name": question.name, **body, **extensions}


def from_systemone(response: dict[str, Any], request: DecisionsRequest) -> dict[str, Any]:
    """The Decisions response for ``request`` from the System One response the Decider gave."""
    answers = [_answer(question, response["answers"][str(i)]) for i, question in enumerate(request.questions)]
    usage = response["usage"]
    return {
        "model": response["model"],
        "answers": answers,
        "usage": {
            "input_tokens": usage["input_tokens"],
            "output_tokens": usage["output_tokens"],
            "total_tokens": usage["input_tokens"] + usage["output_tokens"],
        },
    }
