"""``/v1/chat/completions`` in schema mode, as vLLM's structured-decision example server serves it, ⇄ System One.

Request: an OpenAI chat completion of exactly two messages. The system (or developer) message's text
is the schema JSON: ``{"questions": [{id, type, instructions?, criteria? (noul), options (choice:
names or {name, description}), levels (score), depends_on?, ask_if?, alone?}], ...}`` with the System
One request options at its top level (``instructions``, ``samples``, ``seed``, ``ask``,
``auto_threshold``, ``auto_max``, ``chunk_rows``, ``chunk_prompt``, ``think``, ``steps``, and the ``x_``
ones). ``samples`` defaults to ``"auto"`` here, as on that server. The user message's text is the
state, used verbatim (JSON text stays the text the client sent). The request's own ``seed`` is the
read seed when the schema gives none; its ``model`` must name the served model.

Response: a ``chat.completion`` whose one message's ``content`` is the JSON answer set that server
returns: ``{"answers": {id: answer or null}, "diagnostics": {...}}``. An answer has ``type``,
``label`` (the label that server would read: ``yes``/``no``, ``A``, ``B``, ... for options, ``1``,
``2``, ... for up to 9 levels and letters past that), ``confidence`` (the top probability),
``probabilities`` (yes/no, option names or level texts → p), then ``noul`` (P(yes)), ``choice`` (the
top option) or ``score`` (Σ (i + 1)·pᵢ, 1-based as that server's chat answers are) with ``level`` (the
top level's text), and ``stderr`` (of the top probability) and ``agreement`` when read more than
once. Validation errors are located in this request (``["body", "messages", 0, "content",
"questions", 2, ...]``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from slotread.api.systemone import render_text
from slotread.errors import ErrorDetail, InvalidRequest

#: where the schema and the state sit in the request
SCHEMA_LOC: list[str | int] = ["body", "messages", 0, "content"]
STATE_LOC: list[str | int] = ["body", "messages", 1, "content"]
#: question types that server takes for a noul
NOUL_TYPES = ("noul", "bool", "boolean")
#: the question fields the schema maps onto a System One question as they are
PASSED_THROUGH = ("instructions", "depends_on", "ask_if", "alone")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    """A part of a message's content; only text parts are read."""

    type: str
    text: str | None = None


class ChatMessage(_Wire):
    """A message: the schema (system or developer) or the state (user)."""

    role: str
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatRequest(_Wire):
    """A schema-mode chat completion request; other chat fields (temperature, max_tokens, ...) are ignored."""

    model: str | None = None
    messages: list[ChatMessage]
    seed: StrictInt | None = None


@dataclass(frozen=True)
class Schema:
    """The parsed request: the System One body it becomes, and each question's id, kind and names."""

    body: dict[str, Any]
    #: id → (kind, option names: yes/no, option names or level texts)
    questions: dict[str, tuple[Literal["noul", "choice", "score"], list[str]]]
    #: id → the question's index in the schema, for error locations
    index: dict[str, int]


def _request(body: Any) -> ChatRequest:
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(
            [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors(include_url=False)]
        ) from None
    roles = [m.role for m in request.messages]
    if len(roles) != 2 or roles[0] not in ("system", "developer") or roles[1] != "user":
        msg = "schema mode takes exactly two messages: the schema JSON (system) and the state (user)"
        raise InvalidRequest.at(["body", "messages"], msg)
    for index, message in enumerate(request.messages):
        if isinstance(message.content, list) and any(p.type != "text" for p in message.content):
            raise InvalidRequest.at(
                ["body", "messages", index, "content"], "only text parts are supported yet", "not_supported"
            )
    return request


def _question(item: Any, index: int) -> tuple[str, dict[str, Any], list[str]]:
    """One schema question as (id, System One question, its option names)."""
    loc = [*SCHEMA_LOC, "questions", index]
    if not isinstance(item, dict):
        raise InvalidRequest.at(loc, "a question is an object with id and type")
    qid, kind = item.get("id"), item.get("type")
    if not isinstance(qid, str) or not qid:
        raise InvalidRequest.at([*loc, "id"], "a question needs a non-empty string id")
    question: dict[str, Any] = {k: item[k] for k in PASSED_THROUGH if k in item}
    if kind in NOUL_TYPES:
        question |= {"type": "noul", "criteria": item.get("criteria")}
        return qid, question, ["yes", "no"]
    if kind == "choice":
        options = item.get("options")
        if not isinstance(options, list):
            raise InvalidRequest.at([*loc, "options"], "a choice lists its options: names or {name, description}")
        criteria: dict[str, Any] = {}
        for number, option in enumerate(options):
            name, description = (option, None) if isinstance(option, str) else _named(option, [*loc, "options", number])
            if name in criteria:
                raise InvalidRequest.at([*loc, "options", number], f"option {name!r} is listed twice")
            criteria[name] = description
        return qid, question | {"type": "choice", "criteria": criteria}, list(criteria)
    if kind == "score":
        levels = item.get("levels")
        if not isinstance(levels, list):
            raise InvalidRequest.at([*loc, "levels"], "a score lists its levels, low to high")
        return qid, question | {"type": "score", "criteria": levels}, [render_text(v) or "" for v in levels]
    raise InvalidRequest.at([*loc, "type"], f"type must be noul, choice or score, got {kind!r}")


def _named(option: Any, loc: list[str | int]) -> tuple[str, Any]:
    if not isinstance(option, dict) or not isinstance(option.get("name"), str):
        raise InvalidRequest.at(loc, "an option is a name or an object with a string name and an optional description")
    return option["name"], option.get("description")


def to_systemone(body: Any) -> Schema:
    """The System One body a schema-mode chat request asks for; InvalidRequest located in the chat body."""
    request = _request(body)
    try:
        schema = json.loads(request.messages[0].text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest.at(
            SCHEMA_LOC, f"the system message must be the schema JSON: {exc}", "json_invalid"
        ) from None
    if not isinstance(schema, dict) or not isinstance(schema.get("questions"), list):
        raise InvalidRequest.at(SCHEMA_LOC, "the schema is an object with a questions list")
    questions: dict[str, Any] = {}
    names: dict[str, tuple[Literal["noul", "choice", "score"], list[str]]] = {}
    index: dict[str, int] = {}
    for number, item in enumerate(schema["questions"]):
        qid, question, option_names = _question(item, number)
        if qid in questions:
            raise InvalidRequest.at([*SCHEMA_LOC, "questions", number, "id"], f"question id {qid!r} is used twice")
        questions[qid], names[qid], index[qid] = question, (question["type"], option_names), number
    options: dict[str, Any] = {k: v for k, v in schema.items() if k != "questions"}
    if "samples" not in options and "x_samples" not in options:
        options["samples"] = "auto"
    converted: dict[str, Any] = {**options, "state": request.messages[1].text.strip(), "questions": questions}
    if request.seed is not None:
        converted.setdefault("seed", request.seed)
    if request.model is not None:
        converted["model"] = request.model
    return Schema(body=converted, questions=names, index=index)


def relocate(detail: list[ErrorDetail], schema: Schema) -> list[ErrorDetail]:
    """System One error locations as locations in the chat request."""
    moved: list[ErrorDetail] = []
    for item in detail:
        rest = list(item["loc"][1:])
        if rest[:1] == ["state"]:
            loc = [*STATE_LOC, *rest[1:]]
        elif rest[:1] == ["questions"] and len(rest) > 1 and rest[1] in schema.index:
            loc = [*SCHEMA_LOC, "questions", schema.index[str(rest[1])], *rest[2:]]
        else:
            loc = [*SCHEMA_LOC, *rest]
        moved.append({**item, "loc": loc})
    return moved


def letter_label(index: int) -> str:
    """A, B, ..., Z, AA, AB, ...: the label that server gives the index-th option (it stops at Z)."""
    label = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        label = chr(ord("A") + rest) + label
    return label


def _answer(kind: str, names: list[str], answer: dict[str, Any]) -> dict[str, Any]:
    """A System One answer in that server's shape."""
    probs = [answer["noul"], 1.0 - answer["noul"]] if kind == "noul" else list(answer["probabilities"].values())
    top = max(range(len(probs)), key=probs.__getitem__)
    if kind == "noul":
        label = names[top]
    elif kind == "score" and len(names) <= 9:
        label = str(top + 1)
    else:
        label = letter_label(top)
    body: dict[str, Any] = {
        "type": kind,
        "label": label,
        "confidence": probs[top],
        "probabilities": dict(zip(names, probs, strict=True)),
    }
    if kind == "noul":
        body["noul"] = probs[0]
    elif kind == "choice":
        body["choice"] = names[top]
    else:
        body["score"] = answer["score"] + 1
        body["level"] = names[top]
    if "x_stderr" in answer:
        stderr = answer["x_stderr"]
        body["stderr"] = stderr if kind == "noul" else list(stderr.values())[top]
        body["agreement"] = answer["x_agreement"]
    return body


def from_systemone(response: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """The chat completion carrying a System One response as that server's answer set."""
    answers: dict[str, Any] = {}
    diagnostics: dict[str, Any] = {}
    for qid, (kind, names) in schema.questions.items():  # that server's null for a question not asked
        answer = response["answers"].get(qid)
        answers[qid] = None if answer is None else _answer(kind, names, answer)
        if answer is not None:
            diagnostics[qid] = {k: answer[k] for k in ("x_entropy", "x_label_mass", "x_reads")}
    content = {"answers": answers, "diagnostics": {"engine": "slotread", "questions": diagnostics}}
    usage = response["usage"]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": response["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": json.dumps(content, indent=2)},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["input_tokens"] + usage["output_tokens"],
        },
    }
